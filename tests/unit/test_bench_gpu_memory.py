"""GPU memory budgets of the one-GPU benchmarks and the GPU tests
(vllm_afd_dev.bench.gpu_memory), on CPU, with an 80 GB H100's and a 141 GB
H200's totals as CUDA reports them."""

from __future__ import annotations

import json

import pytest

from vllm_afd_dev import ROOT
from vllm_afd_dev.bench import gpu_memory
from vllm_afd_dev.bench.gpu_memory import (
    ATTENTION,
    COLOCATED,
    FFN,
    MARGIN,
    PROCESS_BYTES,
    GiB,
    GpuMemoryError,
    Process,
    checkpoint_weights,
    deployment,
    gpu_test_engine_args,
    gpu_test_plan,
    kv_cache_bytes,
    most_test_groups,
    one_gpu_memory,
    own_gpus_memory,
    plan_gpu,
    shape_weights,
)
from vllm_afd_dev.bench.shapes import QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS

H100 = int(79.18 * GiB)
H200 = int(139.8 * GiB)
QWEN3_30B = dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS)


@pytest.fixture
def gpu_decode(monkeypatch):
    """benchmarks/afd_gpu_decode.py, as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import afd_gpu_decode

    return afd_gpu_decode


def test_weights_by_role_match_the_measured_8_layer_shape():
    # docs/gpu-runs.md, afd_moe_decode.py at 8 layers: attention 1.44 GiB,
    # FFN 9.00 GiB, a colocated DP rank 5.94 GiB (vLLM shards the experts).
    weights = shape_weights(dict(QWEN3_30B, num_hidden_layers=8))
    assert weights.attention / GiB == pytest.approx(1.44, abs=0.005)
    assert weights.ffn / GiB == pytest.approx(9.00, abs=0.005)
    rank = deployment(dict(QWEN3_30B, num_hidden_layers=8), {}, 0, dp_size=2)[COLOCATED]
    assert rank.weight_bytes / GiB == pytest.approx(5.94, abs=0.005)
    # The router gate moves with compute_gate_on_attention.
    gate = shape_weights(QWEN3_30B, gate_on_attention=True)
    router = 48 * 2048 * 128 * 2
    assert gate.ffn == shape_weights(QWEN3_30B).ffn - router
    assert gate.total == shape_weights(QWEN3_30B).total


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_a_checkpoints_weights_by_role_equal_its_shapes(fixture, request):
    model = request.getfixturevalue(fixture)
    config = json.loads((model / "config.json").read_text())
    assert checkpoint_weights(model) == shape_weights(config, dtype_bytes=4)  # float32 files
    assert checkpoint_weights(model).ffn > 0


def test_a_kv_cache_holds_whole_blocks_and_one_longest_sequence():
    per_token = 2 * 48 * 2 * 4 * 128  # bf16, K and V of 4 heads of 128
    assert kv_cache_bytes(QWEN3_30B, 2, 17) == per_token * 16 * (2 * 2 + 1)  # + the null block
    assert kv_cache_bytes(QWEN3_30B, 1, 10, max_model_len=1024) == per_token * 16 * (64 + 1)


@pytest.mark.parametrize("total", [H100, H200], ids=["H100", "H200"])
def test_the_reported_h100_case_fits_with_both_roles_on_one_gpu(total, gpu_decode):
    """`afd_gpu_decode.py --shape qwen3-30b-a3b --mps on` on an 80 GB H100:
    the FFN rank (started first) held about 56 GB, and the attention engine
    asked for 0.6 of the GPU (47.51 GiB) of the 23.39 GiB free."""
    config, _ = gpu_decode.SHAPES["qwen3-30b-a3b"]
    batches, decode_tokens = [1, 8, 32, 128, 256], 64
    rows = gpu_decode.configs("qwen3-30b-a3b", max(batches))
    kv = kv_cache_bytes(config, max(batches), gpu_decode.sequence_tokens(decode_tokens),
                        gpu_decode.ENGINE["max_model_len"])  # fmt: skip
    planned, plans = gpu_decode.with_memory(rows, config, kv, total)

    afd = plans["AFD graphs"]
    ffn, attention = afd[FFN], afd[ATTENTION]
    assert ffn.process.weight_bytes / GiB == pytest.approx(54.02, abs=0.01)  # the ~56 GB held
    assert ffn.gpu_memory_utilization is None and ffn.engine_args() == {}
    # What vLLM's start-up check asks for is no more than what was free.
    requested = attention.gpu_memory_utilization * total
    if total == H100:
        assert requested <= 23.39 * GiB
    # Both roles' budgets add up within the GPU, the margin aside.
    assert ffn.budget_bytes + attention.budget_bytes <= total * (1 - MARGIN)
    assert ffn.budget_bytes + PROCESS_BYTES + requested <= total
    args = planned["AFD graphs"][0]
    assert args["kv_cache_memory_bytes"] == kv == attention.kv_cache_memory_bytes
    assert args["gpu_memory_utilization"] == attention.gpu_memory_utilization
    assert args["afd_config"]["connector"] == "ipc"
    # The colocated baseline runs alone on the GPU, with the same KV cache.
    colocated = plans["colocated graphs"][COLOCATED]
    assert (
        colocated.process.weight_bytes == ffn.process.weight_bytes + attention.process.weight_bytes
    )
    assert planned["colocated graphs"][0]["kv_cache_memory_bytes"] == kv
    assert 0 < colocated.gpu_memory_utilization <= 1 - MARGIN
    assert colocated.gpu_memory_utilization * total >= colocated.process.tensor_bytes
    for name, plan in plans.items():
        assert sum(b.budget_bytes for b in plan.budgets) <= total * (1 - MARGIN), name


def test_the_old_constant_did_not_fit_the_h100(gpu_decode):
    # What the report says: 0.6 of the H100 next to the FFN rank's 56 GB.
    config, _ = gpu_decode.SHAPES["qwen3-30b-a3b"]
    ffn = deployment(config, {"afd_config": {"connector": "ipc"}}, 0)[FFN]
    assert 0.6 * H100 + ffn.need_bytes > H100


def test_a_deployment_too_big_for_the_gpu_is_refused_naming_the_numbers(gpu_decode):
    config, _ = gpu_decode.SHAPES["qwen3-30b-a3b"]
    rows = gpu_decode.configs("qwen3-30b-a3b", 1024)
    kv = kv_cache_bytes(config, 1024, 2048)  # 1024 sequences of 2048 tokens: 192 GiB
    with pytest.raises(GpuMemoryError) as error:
        gpu_decode.with_memory({"AFD graphs": rows["AFD graphs"]}, config, kv, H100)
    message = str(error.value)
    assert "79.18 GiB" in message and "72.85 GiB" in message  # the GPU, what a plan may give
    assert "need 255.02 GiB, 182.17 GiB too much" in message
    assert "FFN rank 56.43 GiB (weights 54.02, activations 1.40, context 1.00)" in message
    assert "attention engine 198.59 GiB (weights 2.85, activations 2.74, KV cache 192.00" in message
    assert "--batches" in message and "more memory" in message  # what to change
    # The same deployment with a KV cache it can hold fits the H200, not the H100.
    kv = kv_cache_bytes(config, 64, 8192 + 128)
    one_gpu_memory(H200, config, rows["AFD graphs"][0], kv)
    with pytest.raises(GpuMemoryError, match="too much"):
        one_gpu_memory(H100, config, rows["AFD graphs"][0], kv)


def test_a_profiled_kv_cache_takes_the_spare_and_a_fixed_one_only_its_own():
    fixed = Process("fixed", 10 * GiB, GiB, kv_cache_bytes=4 * GiB)
    profiled = Process("profiled", 10 * GiB, GiB, kv_cache_bytes=4 * GiB, profiled_kv=True)
    ffn = Process("ffn", 20 * GiB, GiB, engine=False)
    plan = plan_gpu(H100, [ffn, fixed, profiled])
    usable = int(H100 * (1 - MARGIN))
    assert plan["fixed"].gpu_memory_utilization == pytest.approx(15 * GiB / H100, abs=0.001)
    assert plan["fixed"].kv_cache_memory_bytes == 4 * GiB
    assert plan["profiled"].kv_cache_memory_bytes is None
    spare = usable - ffn.need_bytes - fixed.need_bytes - profiled.need_bytes
    assert plan["profiled"].budget_bytes == profiled.need_bytes + spare
    assert plan["profiled"].gpu_memory_utilization * H100 <= profiled.tensor_bytes + spare
    assert plan["ffn"].engine_args() == {} and plan.spare_bytes == 0
    with pytest.raises(ValueError, match="repeat"):
        plan_gpu(H100, [fixed, fixed])


@pytest.mark.parametrize("total", [H100, H200], ids=["H100", "H200"])
def test_engines_alone_on_their_gpus_get_all_but_the_margin(total):
    """afd_moe_decode.py and afd_serve_sweep.py: each process on a GPU of its own."""
    config = dict(QWEN3_30B, num_hidden_layers=8)
    engine = {"dtype": "bfloat16", "max_num_seqs": 512}
    kv = kv_cache_bytes(config, 512, 145)
    for args, dp in ((engine, 2), (engine | {"afd_config": {"connector": "nccl"}}, 1)):
        memory, plans = own_gpus_memory(total, config, args, kv, dp)
        assert set(memory) == {"gpu_memory_utilization"}  # vLLM sizes the KV cache
        expected = (int(total * (1 - MARGIN)) - PROCESS_BYTES) / total
        assert memory["gpu_memory_utilization"] == pytest.approx(expected, abs=0.001)
        assert len(plans) == (1 if dp == 2 else 2)
    # At Qwen3-30B-A3B's full depth a colocated rank without DP needs more
    # than an H100 with a KV cache for 512 sequences of 1024 tokens.
    big = kv_cache_bytes(QWEN3_30B, 512, 1024)
    if total == H100:
        with pytest.raises(GpuMemoryError, match="the GPU of the colocated engine"):
            own_gpus_memory(total, QWEN3_30B, engine, big)
    else:
        own_gpus_memory(total, QWEN3_30B, engine, big)


@pytest.mark.parametrize("total", [H100, H200], ids=["H100", "H200"])
def test_the_gpu_tests_eight_groups_fit_and_too_many_are_refused(total):
    weights = 80 * 2**20  # above the largest tiny checkpoint
    plan = gpu_test_plan(total, 8, weights)
    fixed = gpu_test_engine_args(plan)
    assert fixed["kv_cache_memory_bytes"] == 2**30
    assert fixed["gpu_memory_utilization"] * total < 2 * GiB  # its own share only
    profiled = gpu_test_engine_args(plan, profiled_kv=True)
    assert set(profiled) == {"gpu_memory_utilization"}
    assert profiled["gpu_memory_utilization"] > fixed["gpu_memory_utilization"]
    assert sum(b.budget_bytes for b in plan.budgets) <= total * (1 - MARGIN)
    most = most_test_groups(total, weights)
    assert most >= 8
    with pytest.raises(GpuMemoryError, match="--jobs"):
        gpu_test_plan(total, most + 1, weights)


def test_the_gpu_tests_settings_come_from_the_plan_of_their_groups(monkeypatch):
    from vllm_afd_dev.harness import gpu_settings

    monkeypatch.setattr(gpu_settings.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_settings, "gpu_total_bytes", lambda: H100)
    monkeypatch.setenv(gpu_memory.TEST_GROUPS_ENV, "3")
    gpu_settings.memory_plan.cache_clear()
    try:
        plan = gpu_test_plan(H100, 3, gpu_settings.largest_checkpoint_bytes(gpu_settings.MODELS))
        engine = gpu_settings.engine("FULL_DECODE_ONLY")
        assert engine["kv_cache_memory_bytes"] == 2**30
        assert (
            engine["gpu_memory_utilization"] == gpu_test_engine_args(plan)["gpu_memory_utilization"]
        )
        profiled = gpu_settings.engine("FULL_DECODE_ONLY", profiled_kv=True)
        assert "kv_cache_memory_bytes" not in profiled
        assert (
            profiled["gpu_memory_utilization"]
            == gpu_test_engine_args(plan, True)["gpu_memory_utilization"]
        )
    finally:
        gpu_settings.memory_plan.cache_clear()


def test_without_cuda_the_gpu_tests_settings_name_no_memory(monkeypatch):
    from vllm_afd_dev.harness import gpu_settings

    monkeypatch.setattr(gpu_settings.torch.cuda, "is_available", lambda: False)
    gpu_settings.memory_plan.cache_clear()
    try:
        assert gpu_settings.memory_args() == {}
        assert "gpu_memory_utilization" not in gpu_settings.engine("eager")
    finally:
        gpu_settings.memory_plan.cache_clear()


def test_the_group_runner_tells_each_group_how_many_share_its_gpu_and_refuses_too_many(
    monkeypatch,
):
    from vllm_afd_dev import gpu_groups
    from vllm_afd_dev.gpu_groups import Group, check_gpu_memory, groups_sharing

    one = [Group(f"g{i}", ("t.py",)) for i in range(3)]
    both = Group("two", ("t.py",), gpus=2)
    other = Group("other", ("t.py",), visible="1")
    assert groups_sharing(one[0], one) == 3
    assert groups_sharing(other, [*one, both, other]) == 2
    assert groups_sharing(both, [*one, both, other]) == 4  # GPU 0 is the busier
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_memory, "gpu_total_bytes", lambda index=0: H100)
    check_gpu_memory(one)
    many = [Group(f"g{i}", ("t.py",)) for i in range(40)]
    with pytest.raises(SystemExit, match=r"At most \d+ groups fit"):
        check_gpu_memory(many)
    assert gpu_groups.TEST_GROUPS_ENV == "AFD_GPU_TEST_GROUPS"


def test_a_generation_on_a_gpu_gets_memory_settings_unless_it_names_them(monkeypatch, tiny_qwen3):
    from vllm_afd_dev.harness import generate

    assert generate.device_memory_args(tiny_qwen3, {}) == {}  # CPU: VLLM_CPU_KVCACHE_SPACE's
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_memory, "gpu_total_bytes", lambda index=0: H100)
    named = {"gpu_memory_utilization": 0.5}
    assert generate.device_memory_args(tiny_qwen3, named) == {}
    memory = generate.device_memory_args(tiny_qwen3, generate.afd_engine_args())
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    assert memory["kv_cache_memory_bytes"] == kv_cache_bytes(config, 8, 512, dtype_bytes=4)
    assert 0 < memory["gpu_memory_utilization"] < 0.05
    command = generate.worker_command(tiny_qwen3, {}, 4, tiny_qwen3 / "out.json")
    engine_args = json.loads(command[command.index("--engine-args") + 1])
    assert engine_args["kv_cache_memory_bytes"] == memory["kv_cache_memory_bytes"]
