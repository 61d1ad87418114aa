"""AFD 1A1F on GPUs: both roles on one H200 over the ipc connector, and (on a
machine with two GPUs) the FFN rank on the second GPU over ipc (peer access)
or nccl.

Greedy outputs must equal stock colocated vLLM with the same settings, token
for token, on the generated random-weight checkpoint (bf16, FLASH_ATTN, Model
Runner V2; prompts of mixed lengths with a 32-token step budget, so chunked
prefills share steps with decodes). Graph runs also check the replay rule
with both roles' step counters: the FFN rank replays exactly when the
attention side does, though eager steps of a captured size occur. Run on the
GPU machine after the devkit is staged and the series applied
(scripts/gpu_prepare.sh apply), with PYTHONPATH=/tmp/site and
AFD_STOCK_VLLM=/tmp/vllm-pristine.
"""

from __future__ import annotations

import functools
import inspect
import time
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import (
    GenerationError,
    afd_engine_args,
    ffn_weight_bytes,
    free_port,
    run,
)
from vllm_afd_dev.harness.gpu_settings import (
    CONNECTORS,
    EAGER_AND_GRAPHS,
    PLACEMENTS,
    SETTINGS,
    check_step_counters,
    engine,
    ffn_cli_args,
    micro_batching,
    micro_batching_env,
    model_engine,
    placement_env,
    runner_env,
)
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    ffn_server,
    kill_ffn_mid_generation,
    zeroed_ffn_rank,
)
from vllm_afd_dev.models.tiny_model import without_tensors


@functools.cache
def stock(model, setting: str, arch: str = "qwen3") -> dict:
    return run(model, model_engine(setting, arch), stock=True, env=runner_env(setting))


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("setting", [*SETTINGS, "FULL_DECODE_ONLY-V1"])
def test_afd_1a1f_matches_colocated(setting, connector, tiny_qwen3, tmp_path):
    """``connector`` names the placement too (gpu_settings.PLACEMENTS)."""
    afd_args = afd_engine_args(
        engine(setting), connector=PLACEMENTS[connector], stats_dir=str(tmp_path)
    )
    afd = run(tiny_qwen3, afd_args, env=runner_env(setting) | placement_env(connector))
    colocated = stock(tiny_qwen3, setting)
    print(f"{setting}: AFD {afd['ms_per_step']:.2f} ms/step, colocated "
          f"{colocated['ms_per_step']:.2f} ms/step")  # fmt: skip
    assert afd["remote_ffn_layers"] == 2 and afd["local_mlp_params"] == []
    assert afd["tokens"] == colocated["tokens"]
    check_step_counters(tmp_path, setting)


@pytest.mark.parametrize("setting", ["FULL_DECODE_ONLY", "FULL_DECODE_ONLY-V1"])
def test_afd_with_a_profiled_kv_cache_matches_colocated(setting, tiny_qwen3, tmp_path):
    """vLLM sizes the KV cache from its memory profile, as a deployment does
    by default. Profiling captures sample graphs into a throwaway pool (V1;
    V2 from vLLM 0.29), and the FFN rank must mirror those captures too. The
    other tests fix the KV cache size, which skips that profiling."""
    profiled = engine(setting, profiled_kv=True)
    args = afd_engine_args(profiled, connector="ipc", stats_dir=str(tmp_path))
    afd = run(tiny_qwen3, args, env=runner_env(setting))
    assert afd["tokens"] == stock(tiny_qwen3, setting)["tokens"]
    check_step_counters(tmp_path, setting)


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize(
    "arch",
    ["qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss",
     "minimax_m2", "kimi_k25", "deepseek_v32", "glm_moe_dsa"],
)  # fmt: skip
def test_moe_1a1f_matches_colocated(arch, setting, gate_on_attention, request, tmp_path):
    """Qwen3-MoE runs on Model Runner V1, DeepSeek-V2 and V3 (MLA) on V2;
    DeepSeek-V3 and GLM-4.5 route with sigmoid scores and a correction bias,
    Qwen3-Next keeps its linear and full attention on the attention side,
    Qwen3.5-MoE too, and its vision tower,
    gpt-oss its sinks and sliding windows (FlashAttention's sink path), with
    the router's bias beside its weight; MiniMax-M2 routes by sigmoid scores
    with the correction bias on its block (its CPU test cannot: vLLM's CPU
    MoE routes ungrouped experts by softmax only). Kimi-K2.5 runs DeepSeek-V3's
    language model (MLA) beside its vision tower. DeepSeek-V3.2 and GLM-5
    (with a float32 router) run DeepSeek Sparse Attention, MLA with the
    indexer and its cache (which vLLM's CPU backend cannot run), on the FP8
    KV cache as DeepSeek-V3.2 is served. The FFN rank takes the second GPU when two are
    visible."""
    model = request.getfixturevalue(f"tiny_{arch}")
    args = afd_engine_args(
        model_engine(setting, arch),
        connector="ipc",
        compute_gate_on_attention=gate_on_attention,
        stats_dir=str(tmp_path),
    )
    afd = run(model, args)
    assert afd["remote_ffn_layers"] == 2
    gate = {"gpt_oss": "mlp.router.", "minimax_m2": "block_sparse_moe.gate.weight"}.get(
        arch, "mlp.gate.weight"
    )
    assert all(gate in name for name in afd["local_mlp_params"])
    colocated = stock(model, setting, arch)
    assert afd["tokens"] == colocated["tokens"]
    # Every weight lives on exactly one side: no expert on the attention side.
    assert afd["weight_bytes"] + sum(ffn_weight_bytes(afd["log"])) == colocated["weight_bytes"]
    check_step_counters(tmp_path, setting)


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_qwen3_5_moe_image_prompts_match_colocated(setting, tiny_qwen3_5_moe, tmp_path):
    """Qwen3.5-MoE with a seeded image in every other prompt: the vision
    tower runs on the attention side, whose image tokens' hidden states go
    through the FFN rank as any others do. The images count: each prompt
    that carries one decodes otherwise than its text alone."""
    arch, model = "qwen3_5_moe", tiny_qwen3_5_moe
    args = afd_engine_args(model_engine(setting, arch), connector="ipc", stats_dir=str(tmp_path))
    afd = run(model, args, images=True)
    colocated = run(model, model_engine(setting, arch), stock=True, images=True)
    assert afd["tokens"] == colocated["tokens"]
    assert afd["vision_bytes"] == colocated["vision_bytes"] > 0
    text_alone = stock(model, setting, arch)["tokens"]
    assert_every_prompt_changed(colocated["tokens"][0::2], text_alone[0::2])
    check_step_counters(tmp_path, setting)


def longcat_flash_as_this_vllm_loads(checkpoint: Path, tmp: Path) -> Path:
    """The tiny LongCat-Flash checkpoint, or where stock vLLM cannot load its
    multi-token-prediction layer (``model.mtp.*``, as the released checkpoint
    stores it) a copy without it. vLLM 0.26.0's ``FlashModel.load_weights``
    skips only names with ``.mtp.`` in them, and the names it is given have
    lost their ``model.``: it stops at ``KeyError: 'mtp.embed_tokens.weight'``
    (seen on an H100, stock and AFD alike). vLLM 0.32.0 skips names that
    start with ``mtp.``, for its MTP model to load them."""
    from vllm.model_executor.models.longcat_flash import FlashModel

    if 'startswith("mtp.")' in inspect.getsource(FlashModel.load_weights):
        return checkpoint
    return without_tensors(checkpoint, tmp / "without-mtp", "model.mtp.")


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_longcat_flash_matches_colocated(setting, tiny_longcat_flash, tmp_path):
    """LongCat-Flash: both dense MLPs of every layer and its shortcut MoE
    (routed and zero-compute experts, sigmoid scores with a correction bias)
    on the FFN rank, in two exchanges per layer; its two MLA attentions per
    layer on the attention side. vLLM's CPU backend runs neither MLA nor
    LongCat's MoE, so this is its end-to-end test. The negative control
    zeroes layer 1's routed experts on the FFN rank: the MoE output reaches
    the attention side only inside the layer's second exchange."""
    arch, model = "longcat_flash", longcat_flash_as_this_vllm_loads(tiny_longcat_flash, tmp_path)
    args = afd_engine_args(model_engine(setting, arch), connector="ipc", stats_dir=str(tmp_path))
    afd = run(model, args)
    assert afd["remote_ffn_layers"] == 4 and afd["local_mlp_params"] == []
    colocated = stock(model, setting, arch)
    assert afd["tokens"] == colocated["tokens"]
    assert afd["weight_bytes"] + sum(ffn_weight_bytes(afd["log"])) == colocated["weight_bytes"]
    check_step_counters(tmp_path, setting)
    engine_args = model_engine(setting, arch)
    with zeroed_ffn_rank(model, tmp_path, engine=ffn_cli_args(setting),
                         connector="ipc") as port:  # fmt: skip
        broken = run(model, attention_args(port, engine=engine_args, connector="ipc"))
    assert_every_prompt_changed(broken["tokens"], colocated["tokens"])


def assert_router_model_matches_colocated(
    arch, model, setting, gate_on_attention, tmp_path, *, layers, moe_layers, gate, zeroed
) -> None:
    """``model`` under AFD against stock vLLM, eager or FULL_DECODE_ONLY, with
    its router on either side: ``layers`` remote FFNs; the attention side
    holds the ``moe_layers`` router weights (names ending with ``gate``)
    where it runs them and none otherwise; the same tokens, the same bytes in
    all. With the router on the FFN side, the negative control zeroes layer
    1's tensors ending with ``zeroed`` on the FFN rank."""
    engine_args = model_engine(setting, arch)
    args = afd_engine_args(
        engine_args,
        connector="ipc",
        compute_gate_on_attention=gate_on_attention,
        stats_dir=str(tmp_path),
    )
    afd = run(model, args)
    assert afd["remote_ffn_layers"] == layers
    assert all(name.endswith(gate) for name in afd["local_mlp_params"])
    assert len(afd["local_mlp_params"]) == (moe_layers if gate_on_attention else 0)
    colocated = stock(model, setting, arch)
    assert afd["tokens"] == colocated["tokens"]
    assert afd["weight_bytes"] + sum(ffn_weight_bytes(afd["log"])) == colocated["weight_bytes"]
    check_step_counters(tmp_path, setting)
    if gate_on_attention:
        return
    with zeroed_ffn_rank(model, tmp_path, engine=ffn_cli_args(setting), zeroed=zeroed,
                         connector="ipc") as port:  # fmt: skip
        broken = run(model, attention_args(port, engine=engine_args, connector="ipc"))
    assert_every_prompt_changed(broken["tokens"], colocated["tokens"])


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_deepseek_v4_matches_colocated(setting, gate_on_attention, tiny_deepseek_v4_fp8, tmp_path):
    """DeepSeek-V4 in its released FP8 form (vLLM 0.26.0: patch 0031): its
    hyper-connections, sparse attention with compressors and indexer stay on
    the attention side; every layer's MoE block on the FFN rank, the first
    routed by token id, which each row carries to it. vLLM's CPU backend
    cannot run V4 (0.26: CUDA streams and FP8 einsums; 0.32 on: AVX-512
    kernels), so this is its end-to-end test. The negative control zeroes
    layer 1's experts' and shared expert's output projections (``w2``)."""
    assert_router_model_matches_colocated(
        "deepseek_v4", tiny_deepseek_v4_fp8, setting, gate_on_attention, tmp_path,
        layers=3, moe_layers=3, gate="ffn.gate.weight", zeroed="w2.weight",
    )  # fmt: skip


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_minimax_m3_matches_colocated(setting, gate_on_attention, tiny_minimax_m3, tmp_path):
    """MiniMax-M3 (vLLM 0.26.0 to 0.33.0: patch 0032): its dense first
    layer's ``mlp`` and its MoE layers' ``block_sparse_moe`` (float32
    router, sigmoid scores with the correction bias on the block, a shared
    expert) on the FFN rank; attention with the sparse-attention indexer on
    the attention side, each layer's FFN all-reduce no longer left to the
    next norm. vLLM's CPU backend cannot import MiniMax-M3, so this is its
    end-to-end test. The negative control zeroes layer 1's routed and shared
    experts' output projections."""
    assert_router_model_matches_colocated(
        "minimax_m3", tiny_minimax_m3, setting, gate_on_attention, tmp_path,
        layers=3, moe_layers=2, gate="block_sparse_moe.gate.weight",
        zeroed=("w2.weight", "down_proj.weight"),
    )  # fmt: skip


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize(
    "setting", ["eager-V1", "FULL_DECODE_ONLY-V1", "eager-V2", "FULL_DECODE_ONLY-V2"]
)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_dbo_1a1f_matches_colocated(arch, setting, connector, stages, request, tmp_path):
    """Micro-batch overlap: ``stages`` stages per step on both roles, against
    stock vLLM without it (stock DBO needs data parallelism and an all2all
    backend). Splitting a batch changes the row count of every kernel, so
    both runs use vLLM's batch-invariant kernels. The V1 settings run Model
    Runner V1's micro-batch wrapper (vLLM 0.33 and earlier); the V2 settings
    V2's UBatchRunner (patch 0028, vLLM 0.32 on; skipped on 0.26), whose
    FULL_DECODE_ONLY graphs include micro-batched twins of the decode graphs,
    announced to the FFN rank with their stages: the step counters of both
    roles must agree and no replay may miss its graph."""
    model = request.getfixturevalue(f"tiny_{arch}")
    env = {**micro_batching_env(setting), "VLLM_BATCH_INVARIANT": "1"}
    overlap = dict(engine(setting), **micro_batching(stages))
    afd_args = afd_engine_args(overlap, connector=PLACEMENTS[connector], stats_dir=str(tmp_path))
    afd = run(model, afd_args, env=env | placement_env(connector))
    colocated = run(model, engine(setting), stock=True, env=env)
    print(f"{arch} {setting} {connector} {stages} stages: AFD {afd['ms_per_step']:.2f} ms/step, "
          f"colocated {colocated['ms_per_step']:.2f} ms/step")  # fmt: skip
    assert afd["tokens"] == colocated["tokens"]
    attention = check_step_counters(tmp_path, setting)
    assert attention.micro_batched > 0


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_negative_control_zeroed_ffn_changes_tokens(setting, tiny_qwen3, tmp_path):
    """The comparison can fail: the FFN rank's layer-1 MLP outputs zero."""
    ffn_args = ffn_cli_args(setting)
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, engine=ffn_args, connector="ipc") as port:
        broken = run(tiny_qwen3, attention_args(port, engine=engine(setting), connector="ipc"))
    assert_every_prompt_changed(broken["tokens"], stock(tiny_qwen3, setting)["tokens"])


def test_killed_ffn_rank_stops_the_attention_side(tiny_qwen3, tmp_path):
    """With graphs the attention GPU waits on the FFN inside a replay; the
    watchdog turns the lost peer into an error and an exit."""
    port, setting = free_port(), "FULL_DECODE_ONLY"
    ffn = ffn_server(
        tiny_qwen3, port, tmp_path / "ffn.log", engine=ffn_cli_args(setting), connector="ipc"
    )
    out = tmp_path / "out.json"
    # Long enough (several seconds of decoding) to be mid-generation at the kill.
    long_run = dict(engine(setting), max_model_len=2048)
    args = attention_args(port, timeout_s=30, engine=long_run, connector="ipc")
    code, elapsed, log = kill_ffn_mid_generation(tiny_qwen3, args, ffn, out, 120, 1900)
    print(f"attention side exited {elapsed:.1f} s after the FFN rank was killed")
    assert code != 0 and not out.exists()
    lost = f"AFD attention rank 0: lost the FFN rank at 127.0.0.1:{port}"
    assert lost in log, failure_report(log)
    assert elapsed < 60, elapsed


def test_nccl_refuses_two_roles_on_one_gpu(tiny_qwen3):
    start = time.monotonic()
    with pytest.raises(GenerationError) as failure:
        run(
            tiny_qwen3,
            # Bounds the start of both processes as well: generous on a busy machine.
            afd_engine_args(engine("eager"), connector="nccl", timeout_s=180),
            env={"CUDA_VISIBLE_DEVICES": "0"},  # one GPU for both roles, on any machine
        )
    assert "share one GPU, and NCCL runs one rank per GPU" in failure.value.output
    assert "use the ipc connector" in failure.value.output
    print(f"nccl on one GPU refused after {time.monotonic() - start:.1f} s")
