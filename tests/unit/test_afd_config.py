"""AFDConfig in the patched vLLM: good and bad configs through every entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from vllm.afd.attention.launcher import ffn_command, ffn_side_afd_config
from vllm.afd.ffn.worker import check_group_fits_the_gpus, ffn_device_index
from vllm.config import (
    AFDConfig,
    CompilationConfig,
    CUDAGraphMode,
    ParallelConfig,
    VllmConfig,
)
from vllm.config.afd import resolve_afd_defaults, verify_afd_with_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_afd_dev.harness.generate import stock_vllm_path

GOOD = [
    {},
    {"role": "ffn", "connector": "nccl", "num_attention_ranks": 4, "num_ffn_ranks": 2},
    {
        "connector": "ipc",
        "host": "::1",
        "port": 1,
        "timeout_s": 0.5,
        "compute_gate_on_attention": True,
        "spawn_ffn": True,
        "ffn_first_device": 2,
        "connector_extra_config": {"buffer_mb": 8},
    },
    {"failover_timeout_s": 30},
    {"failover_timeout_s": 30, "failover_hosts": ["127.0.0.2", "localhost"]},
    {"role": "ffn", "standby": True},
    {"mps_active_thread_percentage": {"attention": 40, "ffn": 60}},
    {"connector": "ipc", "ipc_signal": "kernel", "mps": "start"},
    {"connector": "ipc", "ipc_signal": "stream"},
    {"connector": "nccl", "ipc_signal": "auto"},  # the default, on any connector
]

BAD = [
    ({"role": "decoder"}, "Input should be 'attention' or 'ffn'"),
    ({"connector": "tcp"}, r"unknown AFD connector 'tcp'; available: \['gloo', 'ipc', 'nccl'\]"),
    (
        {"bogus": 1, "role": "ffn"},
        r"unknown AFD config key\(s\) \['bogus'\]; valid keys are "
        r"\['attention_rank', 'compute_gate_on_attention'",
    ),
    ({"port": 0}, "AFD port 0 is out of range"),
    ({"port": 70000}, "AFD port 70000 is out of range"),
    ({"num_attention_ranks": 1, "num_ffn_ranks": 2}, "topology 1A:2F is invalid"),
    ({"num_attention_ranks": 3, "num_ffn_ranks": 2}, "topology 3A:2F is invalid"),
    ({"num_attention_ranks": 0}, "at least one rank of each role"),
    ({"timeout_s": 0}, "timeout_s must be positive"),
    ({"host": ""}, "host must not be empty"),
    ({"role": "ffn", "spawn_ffn": True}, "spawn_ffn is an attention-side option"),
    ({"ffn_first_device": -1}, "ffn_first_device must be a visible GPU index"),
    ({"failover_timeout_s": -1}, "failover_timeout_s must be 0 \\(no failover\\) or positive"),
    ({"standby": True}, "standby is an FFN-side option"),
    ({"failover_hosts": ["127.0.0.2"]}, "set failover_timeout_s above 0 with them"),
    ({"failover_timeout_s": 9, "failover_hosts": [""]}, r"failover_hosts \[''\] has an empty"),
    (
        {"failover_timeout_s": 9, "failover_hosts": ["127.0.0.2", "10.0.0.7"]},
        "AFD host '10.0.0.7' is not a loopback address",
    ),
    ({"role": "ffn", "attention_rank": 0}, "attention_rank is an attention-side option"),
    ({"num_attention_ranks": 2, "attention_rank": 2}, r"attention_rank 2 is outside 0\.\.1"),
    ({"attention_rank": 0, "spawn_ffn": True}, "with attention_rank each attention rank is a"),
    ({"attention_rank": 0, "connector": "ipc"}, "run on the gloo connector"),
    (
        {"mps_active_thread_percentage": {"ffn": 0}},
        r"mps_active_thread_percentage \{'ffn': 0\} is not valid: .* in 1..100",
    ),
    ({"mps_active_thread_percentage": {"decoder": 50}}, "Input should be 'attention' or 'ffn'"),
    ({"connector": "ipc", "ipc_signal": "spin"}, "Input should be 'auto', 'stream' or 'kernel'"),
    (
        {"ipc_signal": "kernel"},
        'ipc_signal "kernel" applies to the ipc connector only, not to "gloo"',
    ),
    (
        {"connector": "nccl", "ipc_signal": "stream"},
        'ipc_signal "stream" applies to the ipc connector only, not to "nccl"',
    ),
]


@pytest.fixture(scope="module")
def parser():
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("cfg", GOOD)
def test_good_configs_through_every_entry_point(cfg, parser):
    direct = AFDConfig(**cfg)
    via_engine_args = EngineArgs(model="m", afd_config=dict(cfg)).afd_config
    via_cli = EngineArgs.from_cli_args(
        parser.parse_args(["--model", "m", "--afd-config", json.dumps(cfg)])
    ).afd_config
    assert direct == via_engine_args == via_cli
    assert isinstance(via_cli, AFDConfig)


@pytest.mark.parametrize(("cfg", "message"), BAD)
def test_bad_configs_say_what_is_wrong(cfg, message, parser, capsys):
    with pytest.raises(ValueError, match=message):
        AFDConfig(**cfg)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", afd_config=dict(cfg))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--model", "m", "--afd-config", json.dumps(cfg)])
    assert exit_info.value.code == 2
    assert "argument --afd-config" in capsys.readouterr().err


def test_dotted_cli_keys(parser):
    args = parser.parse_args(
        ["--model", "m", "--afd-config.role", "ffn", "--afd-config.port", "4000"]
    )
    assert EngineArgs.from_cli_args(args).afd_config == AFDConfig(role="ffn", port=4000)


def test_topology_mapping():
    cfg = AFDConfig(num_attention_ranks=4, num_ffn_ranks=2)
    assert [cfg.ffn_rank_of(a) for a in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="attention rank 4 outside 0..3"):
        cfg.ffn_rank_of(4)


@pytest.mark.parametrize(
    ("afd", "attention_tp_size", "gpus", "placed"),
    [
        # a GPU for every process: the FFN processes after the attention ranks'
        ({"num_attention_ranks": 2, "ffn_tensor_parallel_size": 2}, 1, 4, [[2, 3]]),
        ({"num_attention_ranks": 2, "num_ffn_ranks": 2}, 1, 4, [[2], [3]]),
        ({"ffn_tensor_parallel_size": 2}, 2, 4, [[2, 3]]),
        ({"num_attention_ranks": 2, "ffn_tensor_parallel_size": 2}, 2, 8, [[4, 5]]),
        # fewer GPUs: shared, the leader away from attention TP rank 0 (nccl)
        ({}, 2, 2, [[1]]),
        ({"ffn_tensor_parallel_size": 2}, 2, 2, [[1, 0]]),
        ({}, 1, 1, [[0]]),
        # placed by hand
        ({"ffn_first_device": 1, "ffn_tensor_parallel_size": 2}, 2, 4, [[1, 2]]),
    ],
)
def test_spawned_ffn_processes_take_their_own_gpus_when_there_are_enough(
    afd, attention_tp_size, gpus, placed
):
    spawning = AFDConfig(**afd, spawn_ffn=True)
    ffn = AFDConfig(**ffn_side_afd_config(spawning, attention_tp_size, gpus))
    assert ffn.role == "ffn" and not ffn.spawn_ffn
    assert [
        [ffn_device_index(ffn, f, t, gpus) for t in range(ffn.ffn_tensor_parallel_size)]
        for f in range(ffn.num_ffn_ranks)
    ] == placed


def test_an_ffn_side_started_by_hand_counts_one_gpu_per_attention_rank():
    assert ffn_device_index(AFDConfig(role="ffn", num_attention_ranks=2), 0, 0, 4) == 2


def test_an_ffn_group_needs_a_gpu_per_process(monkeypatch):
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    check_group_fits_the_gpus(2, 2)
    check_group_fits_the_gpus(1, 1)
    with pytest.raises(ValueError, match="group of 2 processes .* needs a GPU for each, but the"):
        check_group_fits_the_gpus(2, 1)
    # Each process a host of its own for NCCL: the one-GPU test placement.
    monkeypatch.setenv("NCCL_HOSTID", "afd-ffn-0-1")
    check_group_fits_the_gpus(2, 1)


def config_holder(afd, compilation=None, device="cpu", v2_runner=False, v1_gone=False, **parallel):
    """The parts of a VllmConfig that verify_afd_with_vllm_config reads and
    resolve_afd_defaults settles; ``v1_gone``: as from vLLM 0.34, which has
    no Model Runner V1 and no ``use_v2_model_runner``."""
    holder = SimpleNamespace(
        afd_config=afd,
        use_v2_model_runner=v2_runner,
        compilation_config=compilation or CompilationConfig(),
        model_config=None,
        speculative_config=None,
        device_config=SimpleNamespace(device_type=device),
        parallel_config=ParallelConfig(**parallel),
    )
    if v1_gone:
        del holder.use_v2_model_runner
    return holder


@pytest.mark.parametrize(
    ("mode", "result"),
    [
        (None, CUDAGraphMode.FULL_DECODE_ONLY),
        ("FULL_DECODE_ONLY", CUDAGraphMode.FULL_DECODE_ONLY),
        ("NONE", CUDAGraphMode.NONE),
        ("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
        ("PIECEWISE", "PIECEWISE"),
        ("FULL", "FULL"),
    ],
)
def test_cudagraph_mode_rule(mode, result):
    holder = config_holder(AFDConfig(), CompilationConfig(cudagraph_mode=mode))
    if isinstance(result, str):
        with pytest.raises(
            ValueError, match=f"got {result}. Pass -cc.cudagraph_mode=FULL_DECODE_ONLY"
        ):
            verify_afd_with_vllm_config(holder)
    else:
        verify_afd_with_vllm_config(holder)
        # Verification only checks: an unset mode is settled by the next step.
        assert holder.compilation_config.cudagraph_mode == (None if mode is None else result)
        resolve_afd_defaults(holder)
        assert holder.compilation_config.cudagraph_mode == result


VERIFIED = [
    ({}, "cpu", {}),
    ({"role": "ffn"}, "cpu", {}),
    ({"connector": "ipc", "mps": "start"}, "cuda", {}),
    ({"connector": "ipc", "mps_active_thread_percentage": {"attention": 40}}, "cuda", {}),
    ({"connector": "nccl", "role": "ffn", "ffn_tensor_parallel_size": 2,
      "ffn_enable_expert_parallel": True}, "cuda", {}),
    ({"failover_timeout_s": 30, "num_attention_ranks": 2}, "cpu", {"data_parallel_size": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("afd", "device", "parallel"), VERIFIED)
def test_verification_changes_nothing(afd, device, parallel, monkeypatch):
    """Neither the environment (OpenMP's wait policy, MPS) nor the other
    configs: those are the process set-up's and resolve_afd_defaults'."""
    from vllm.afd.platform import mps

    def no_daemon():
        raise AssertionError("verification started an MPS daemon")

    monkeypatch.setattr(mps, "ensure_private_daemon", no_daemon)
    for variable in ("OMP_WAIT_POLICY", mps.THREAD_PERCENTAGE_VARIABLE, mps.PIPE_DIR_VARIABLE):
        monkeypatch.setenv(variable, "")  # so that the test ends with it as it was
        monkeypatch.delenv(variable)
    environment = dict(os.environ)
    holder = config_holder(AFDConfig(**afd), device=device, **parallel)
    holder.compilation_config.cudagraph_mode = None
    parallel_before = repr(holder.parallel_config)
    verify_afd_with_vllm_config(holder)
    assert dict(os.environ) == environment
    assert holder.compilation_config.cudagraph_mode is None
    assert repr(holder.parallel_config) == parallel_before


def test_vllm_config_rejects_other_graph_modes_and_hashes_afd():
    with pytest.raises(ValueError, match="AFD supports cudagraph_mode FULL_DECODE_ONLY or NONE"):
        VllmConfig(
            afd_config=AFDConfig(),
            compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"),
        )
    plain = VllmConfig().compute_hash()
    attention = VllmConfig(afd_config=AFDConfig()).compute_hash()
    ffn = VllmConfig(afd_config=AFDConfig(role="ffn")).compute_hash()
    moved = VllmConfig(afd_config=AFDConfig(port=4000, timeout_s=5)).compute_hash()
    assert len({plain, attention, ffn}) == 3
    assert moved == attention  # addresses and timeouts do not change the graph


HASH_SNIPPET = """
import sys
import vllm
from vllm.engine.arg_utils import EngineArgs
cfg = EngineArgs(model=sys.argv[1], dtype="float32").create_engine_config()
print("RESULT", vllm.__file__, cfg.compute_hash())
"""


def test_without_afd_the_config_hash_is_stock(tiny_qwen3):
    """No afd_config: the patched vLLM builds the same config as stock."""
    stock = stock_vllm_path()
    results = []
    for pythonpath in (None, str(stock)):
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        proc = subprocess.run(
            [sys.executable, "-c", HASH_SNIPPET, str(tiny_qwen3)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
        results.append(line.split()[1:])
    (patched_file, patched_hash), (stock_file, stock_hash) = results
    assert stock_file.startswith(str(stock)) and patched_file != stock_file
    assert patched_hash == stock_hash


@pytest.mark.parametrize(
    ("afd", "parallel", "message"),
    [
        ({"role": "ffn"}, {"tensor_parallel_size": 2}, "drop --tensor-parallel-size"),
        ({"role": "ffn"}, {"enable_expert_parallel": True}, "ffn_enable_expert_parallel"),
        ({}, {"pipeline_parallel_size": 2}, "use pipeline_parallel_size=1"),
        (
            {"num_attention_ranks": 2, "num_ffn_ranks": 2},
            {},
            "num_attention_ranks=2 but the attention deployment has data_parallel_size=1",
        ),
        (
            {"num_attention_ranks": 2, "attention_rank": 1},
            {"data_parallel_size": 2},
            "makes this engine one attention rank of its own, but it has data_parallel_size=2",
        ),
    ],
)
def test_topology_must_fit_the_deployment(afd, parallel, message):
    with pytest.raises(ValueError, match=message):
        verify_afd_with_vllm_config(config_holder(AFDConfig(**afd), **parallel))


def test_an_attention_rank_of_its_own_runs_without_data_parallel_peers():
    afd = AFDConfig(num_attention_ranks=2, attention_rank=1, failover_timeout_s=30)
    verify_afd_with_vllm_config(config_holder(afd))
    assert afd.separate_attention_ranks and afd.ffn_rank_of(afd.attention_rank) == 0
    assert not AFDConfig(num_attention_ranks=2).separate_attention_ranks


@pytest.mark.parametrize(("a", "f"), [(2, 1), (2, 2), (4, 2)])
def test_data_parallel_attention_ranks_fit(a, f):
    afd = AFDConfig(num_attention_ranks=a, num_ffn_ranks=f)
    verify_afd_with_vllm_config(config_holder(afd, data_parallel_size=a))
    # The FFN role is not data parallel: its side of the same topology runs DP 1.
    ffn = AFDConfig(role="ffn", num_attention_ranks=a, num_ffn_ranks=f)
    verify_afd_with_vllm_config(config_holder(ffn))


@pytest.mark.parametrize(
    ("afd", "message"),
    [
        ({"ffn_tensor_parallel_size": 0}, "ffn_tensor_parallel_size must be at least 1"),
        ({"ffn_enable_expert_parallel": True}, "set ffn_tensor_parallel_size to 2 or more"),
    ],
)
def test_ffn_group_sizes_are_checked(afd, message):
    with pytest.raises(ValueError, match=message):
        AFDConfig(**afd)


def test_ffn_group_sets_the_ffn_sides_expert_parallelism():
    group = {"ffn_tensor_parallel_size": 2, "ffn_enable_expert_parallel": True}
    holder = config_holder(AFDConfig(role="ffn", connector="nccl", **group), device="cuda")
    holder.model_config = SimpleNamespace(architecture="Qwen3MoeForCausalLM", enforce_eager=True)
    verify_afd_with_vllm_config(holder)
    assert not holder.parallel_config.enable_expert_parallel  # verification only checks
    resolve_afd_defaults(holder)
    assert holder.parallel_config.enable_expert_parallel
    # The attention side's parallel config is its own.
    attention = config_holder(AFDConfig(connector="nccl", **group), device="cuda")
    resolve_afd_defaults(attention)
    assert not attention.parallel_config.enable_expert_parallel
    # Both fields change what the FFN side computes.
    assert AFDConfig(**group).compute_hash() != AFDConfig().compute_hash()


def test_ffn_group_takes_graphs_like_a_one_process_rank():
    group = config_holder(AFDConfig(connector="nccl", ffn_tensor_parallel_size=2), device="cuda")
    group.compilation_config.cudagraph_mode = None
    verify_afd_with_vllm_config(group)
    resolve_afd_defaults(group)
    assert group.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY


def test_ffn_group_refusals():
    eager = CompilationConfig(cudagraph_mode="NONE")
    with pytest.raises(ValueError, match="ffn_enable_expert_parallel needs GPUs"):
        cpu_ep = AFDConfig(ffn_tensor_parallel_size=2, ffn_enable_expert_parallel=True)
        verify_afd_with_vllm_config(config_holder(cpu_ep))
    dense = config_holder(
        AFDConfig(connector="nccl", ffn_tensor_parallel_size=2, ffn_enable_expert_parallel=True),
        eager,
        device="cuda",
    )
    dense.model_config = SimpleNamespace(architecture="Qwen3ForCausalLM", enforce_eager=True)
    with pytest.raises(ValueError, match="shares MoE experts, but Qwen3ForCausalLM has none"):
        verify_afd_with_vllm_config(dense)


def test_attention_ranks_may_be_tensor_parallel():
    verify_afd_with_vllm_config(config_holder(AFDConfig(), tensor_parallel_size=2))


def test_gloo_connector_needs_cpu_tensors():
    with pytest.raises(
        ValueError, match="gloo connector moves CPU tensors, but this engine runs on cuda"
    ):
        verify_afd_with_vllm_config(config_holder(AFDConfig(), device="cuda"))
    verify_afd_with_vllm_config(config_holder(AFDConfig(connector="nccl"), device="cuda"))


def test_failover_runs_where_a_forward_is_redone_or_resumed_in_place():
    failover = {"failover_timeout_s": 30}
    verify_afd_with_vllm_config(config_holder(AFDConfig(**failover)))
    # TP attention on gloo resumes in place (redo_limits), on either runner.
    for v2 in (False, True):
        verify_afd_with_vllm_config(config_holder(AFDConfig(**failover), tensor_parallel_size=2,
                                                  v2_runner=v2))  # fmt: skip
    two = AFDConfig(num_attention_ranks=2, **failover)
    verify_afd_with_vllm_config(config_holder(two, data_parallel_size=2))
    # ipc: the attention rank's graphs hold only its own buffer.
    verify_afd_with_vllm_config(config_holder(AFDConfig(connector="ipc", **failover),
                                              device="cuda"))  # fmt: skip
    # nccl: a new communicator, the forward redone, no graph replayed after.
    for v2 in (False, True):
        verify_afd_with_vllm_config(config_holder(AFDConfig(connector="nccl", **failover),
                                                  device="cuda", v2_runner=v2))  # fmt: skip
    # The FFN side has nothing to redo: a failover setting there changes nothing.
    verify_afd_with_vllm_config(config_holder(AFDConfig(role="ffn", connector="nccl", **failover),
                                              device="cuda", v2_runner=True))  # fmt: skip


@pytest.mark.parametrize("v1_gone", [False, True], ids=["v2-chosen", "v1-gone"])
@pytest.mark.parametrize(("connector", "device"), [("ipc", "cuda"), ("gloo", "cpu")])
def test_failover_runs_on_model_runner_v2(connector, device, v1_gone, monkeypatch):
    """On ipc the forward in flight resumes in place, whichever runner
    announced it; on gloo V2's model call is redone (patch 0027). So both run
    where V2 is chosen (VLLM_USE_V2_MODEL_RUNNER=1, up to vLLM 0.33) and where
    it is all there is (0.34, whose CPU runner is V2's too)."""
    if v1_gone:
        without_model_runner_v1(monkeypatch)
    afd = AFDConfig(connector=connector, failover_timeout_s=30)
    verify_afd_with_vllm_config(config_holder(afd, device=device, v2_runner=not v1_gone,
                                              v1_gone=v1_gone))  # fmt: skip
    two = AFDConfig(connector=connector, failover_timeout_s=30, num_attention_ranks=2)
    verify_afd_with_vllm_config(config_holder(two, device=device, v2_runner=not v1_gone,
                                              v1_gone=v1_gone, data_parallel_size=2))  # fmt: skip


@pytest.mark.parametrize(
    ("afd", "device", "parallel", "message"),
    [
        ({"connector": "nccl"}, "cuda", {"tensor_parallel_size": 2},
         "on the nccl connector a lost FFN rank's forward runs again .its 2 tensor-parallel"),
        ({"connector": "nccl"}, "cuda", {"tensor_parallel_size": 2, "v2_runner": True},
         "on the nccl connector a lost FFN rank's forward runs again .its 2 tensor-parallel"),
        ({}, "cpu", {"enable_dbo": True}, "micro-batch overlap"),
        ({"connector": "ipc", "num_attention_ranks": 2}, "cuda",
         {"enable_dbo": True, "v2_runner": True, "data_parallel_size": 2},
         "micro-batch overlap's stages resume in place where an FFN rank serves one"),
        ({"connector": "ipc", "num_attention_ranks": 2}, "cuda",
         {"ubatch_size": 3, "v2_runner": True, "data_parallel_size": 2},
         "micro-batch overlap's stages resume in place where an FFN rank serves one"),
    ],
)  # fmt: skip
def test_failover_is_refused_where_no_failover_keeps_the_forward(afd, device, parallel, message):
    holder = config_holder(AFDConfig(failover_timeout_s=30, **afd), device=device, **parallel)
    with pytest.raises(ValueError, match=f"failover_timeout_s cannot be used here: {message}"):
        verify_afd_with_vllm_config(holder)


def test_attention_ranks_of_their_own_that_would_resume_in_place_are_refused():
    # TP attention resumes in place; ranks of their own count steps apart.
    apart = AFDConfig(num_attention_ranks=2, attention_rank=1, failover_timeout_s=30)
    with pytest.raises(ValueError, match="count their steps apart") as refused:
        verify_afd_with_vllm_config(config_holder(apart, tensor_parallel_size=2))
    assert "tensor-parallel ranks wait in collectives" in str(refused.value)
    # Alone on its FFN rank, or redone, it runs.
    alone = AFDConfig(num_attention_ranks=2, num_ffn_ranks=2, attention_rank=1,
                      failover_timeout_s=30)  # fmt: skip
    verify_afd_with_vllm_config(config_holder(alone, tensor_parallel_size=2))
    verify_afd_with_vllm_config(config_holder(apart))


def test_micro_batch_overlap_keeps_failover_where_its_stages_resume_in_place():
    """On ipc, an FFN rank of its own: the stages resume in place (whichever
    runner micro-batches; Model Runner V1 here). On gloo no redo reaches the
    stages' threads."""
    for split in ({"enable_dbo": True}, {"ubatch_size": 3}):
        holder = config_holder(AFDConfig(connector="ipc", failover_timeout_s=30),
                               device="cuda", **split)  # fmt: skip
        verify_afd_with_vllm_config(holder)
    gloo = config_holder(AFDConfig(connector="gloo", failover_timeout_s=30), enable_dbo=True)
    with pytest.raises(ValueError) as refused:
        verify_afd_with_vllm_config(gloo)
    message = str(refused.value)
    assert "its stages resume in place on the ipc connector only" in message
    assert "Set failover_timeout_s to 0" in message


def without_model_runner_v1(monkeypatch) -> None:
    """Make the installed vLLM look like 0.34, whose VllmConfig class has no
    ``use_v2_model_runner`` (``vllm.afd.runners`` reads the class)."""
    import vllm.config

    monkeypatch.setattr(vllm.config, "VllmConfig", type("VllmConfigWithoutV1", (), {}))


@pytest.mark.parametrize("v1_gone", [False, True], ids=["V2-chosen", "no-V1"])
def test_micro_batch_overlap_runs_on_model_runner_v2_where_it_micro_batches(v1_gone, monkeypatch):
    """Model Runner V2 micro-batches an AFD attention rank from vLLM 0.30 on
    (patch 0028), chosen (VLLM_USE_V2_MODEL_RUNNER=1) or the only runner
    (vLLM 0.34); vLLM 0.26's V2 cannot, and is refused, naming the way out."""
    from vllm.afd.attention import dbo

    for parallel in ({"enable_dbo": True}, {"ubatch_size": 3}):
        verify_afd_with_vllm_config(config_holder(AFDConfig(), **parallel))  # V1
    if v1_gone:
        without_model_runner_v1(monkeypatch)
    on_v2 = {"v1_gone": True} if v1_gone else {"v2_runner": True}
    for micro_batches in (True, False):
        monkeypatch.setattr(dbo, "model_runner_v2_micro_batches", lambda m=micro_batches: m)
        for parallel in ({"enable_dbo": True}, {"ubatch_size": 3}):
            holder = config_holder(AFDConfig(), **on_v2, **parallel)
            if micro_batches:
                verify_afd_with_vllm_config(holder)
                continue
            with pytest.raises(
                ValueError, match="would run on Model Runner V2, which cannot split a step"
            ):
                verify_afd_with_vllm_config(holder)


def test_an_attention_rank_is_refused_on_a_cpu_runner_without_afd_hooks(monkeypatch):
    """vLLM 0.34 runs StandaloneCPUModelRunner on a CPU other than x86 without
    Triton: no AFD patch reaches it, so the attention role refuses to start
    there; the FFN role runs its own runner and is not concerned."""
    from vllm.platforms import current_platform

    verify_afd_with_vllm_config(config_holder(AFDConfig()))
    monkeypatch.setattr(type(current_platform), "uses_standalone_cpu_model_runner",
                        classmethod(lambda cls: True), raising=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="runs its StandaloneCPUModelRunner, which AFD's") as e:
        verify_afd_with_vllm_config(config_holder(AFDConfig(), v1_gone=True))
    assert "Install Triton with a CPU backend (triton-cpu)" in str(e.value)
    verify_afd_with_vllm_config(config_holder(AFDConfig(role="ffn"), v1_gone=True))
    # On a GPU the CPU runner does not run.
    verify_afd_with_vllm_config(config_holder(AFDConfig(connector="ipc"), device="cuda"))


def test_the_compile_factors_are_those_the_hash_is_made_of():
    """vLLM up to 0.33 folds AFDConfig.compute_hash into the config hash,
    0.34 on the dict of compile_factors (patch 0001's variant): the same
    fields, unchanged by addresses and timeouts."""
    afd = AFDConfig(role="ffn", connector="nccl", num_attention_ranks=2)
    factors = afd.compile_factors()
    assert factors["role"] == "ffn" and factors["num_attention_ranks"] == 2
    moved = AFDConfig(role="ffn", connector="nccl", num_attention_ranks=2, port=4000, timeout_s=5)
    assert moved.compile_factors() == factors and moved.compute_hash() == afd.compute_hash()
    assert AFDConfig().compile_factors() != factors


def test_a_model_with_recurrent_state_fails_over_in_place(tiny_qwen3_next):
    # In a process of its own: vLLM's Qwen3-Next config, once loaded, changes
    # how transformers builds that model in this process (the tiny-model tests).
    check = (
        "import sys; from vllm.engine.arg_utils import EngineArgs; "
        "from vllm.distributed.afd_transfer.failover import redo_limits; "
        "c = EngineArgs(model=sys.argv[1], afd_config={'failover_timeout_s': 30})"
        ".create_engine_config(); print(redo_limits(c))"
    )
    run = subprocess.run([sys.executable, "-c", check, str(tiny_qwen3_next)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # A redo would apply the recurrent state's step twice: the rank resumes in place.
    assert "Qwen3NextForCausalLM keeps a recurrent state" in run.stdout, run.stdout[-3000:]


def test_unsupported_architecture_lists_the_supported_ones(tiny_qwen3):
    args = EngineArgs(
        model=str(tiny_qwen3),
        afd_config={},
        hf_overrides={"architectures": ["MistralForCausalLM"]},
    )
    with pytest.raises(ValueError, match="AFD does not support the architecture") as error:
        args.create_engine_config()
    supported = [
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM",
        "Glm4MoeForCausalLM",
        "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM",
        "KimiK25ForConditionalGeneration",
        "LlamaForCausalLM",
        "LongcatFlashForCausalLM",
        "MiniMaxM2ForCausalLM",
        "MiniMaxM3SparseForCausalLM",
        "MiniMaxM3SparseForConditionalGeneration",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    ]
    assert str(supported) in str(error.value)


def test_gate_on_attention_is_refused_for_a_dense_model(tiny_qwen3):
    args = EngineArgs(model=str(tiny_qwen3), afd_config={"compute_gate_on_attention": True})
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no router"):
        args.create_engine_config()
    # Without AFD the same model builds a config.
    EngineArgs(
        model=str(tiny_qwen3), hf_overrides={"architectures": ["MistralForCausalLM"]}
    ).create_engine_config()


@pytest.mark.parametrize(
    "setting",
    [{"compute_gate_on_attention": True},
     {"ffn_enable_expert_parallel": True, "ffn_tensor_parallel_size": 2}],
    ids=["gate-attn", "expert-parallel"],
)  # fmt: skip
def test_longcat_flash_keeps_its_router_and_experts_together(setting, tiny_longcat_flash):
    """LongCat-Flash's shortcut MoE runs whole on the FFN rank, in the first
    of each layer's two exchanges: no gate on the attention side, no expert
    parallelism (which the message names, rather than calling it dense)."""
    args = EngineArgs(model=str(tiny_longcat_flash), afd_config=setting)
    with pytest.raises(ValueError, match="LongcatFlashForCausalLM's MoE block runs on a shortcut"):
        args.create_engine_config()


def test_speculative_decoding_is_refused(tiny_qwen3):
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    args = EngineArgs(model=str(tiny_qwen3), afd_config={}, speculative_config=speculative)
    with pytest.raises(ValueError, match="AFD does not run speculative decoding"):
        args.create_engine_config()
    # Without AFD the same speculative settings build a config.
    EngineArgs(model=str(tiny_qwen3), speculative_config=speculative).create_engine_config()


def test_spawned_ffn_command_carries_the_attention_sides_settings(tiny_qwen3):
    """The ``vllm afd-ffn`` command that ``spawn_ffn`` runs parses back into
    an FFN-role config with the attention side's model and group settings."""
    afd = {"spawn_ffn": True, "ffn_tensor_parallel_size": 2}
    attention = EngineArgs(
        model=str(tiny_qwen3), dtype="float32", enforce_eager=True,
        disable_custom_all_reduce=True, afd_config=afd,
    ).create_engine_config()  # fmt: skip
    cmd = ffn_command(attention)
    assert cmd[3:5] == ["afd-ffn", str(tiny_qwen3)]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ffn_args = parser.parse_args(["--model", *cmd[4:]])
    ffn = EngineArgs.from_cli_args(ffn_args).create_engine_config()
    assert ffn.afd_config.role == "ffn" and not ffn.afd_config.spawn_ffn
    assert ffn.afd_config.ffn_tensor_parallel_size == 2
    assert ffn.parallel_config.disable_custom_all_reduce
    assert ffn.model_config.enforce_eager and ffn.model_config.dtype == attention.model_config.dtype
