"""Engine settings, GPU placements, GPU-count marks and step-counter checks
shared by the GPU tests (tests/gpu; tests/gpu/conftest.py marks every test
there ``gpu`` and skips it without CUDA)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from vllm.distributed.afd_transfer.step_stats import GraphStepStats, StepRecord

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.gpu_memory import (
    TEST_GROUPS_ENV,
    GpuPlan,
    gpu_test_engine_args,
    gpu_test_plan,
    gpu_total_bytes,
    largest_checkpoint_bytes,
)
from vllm_afd_dev.gpu_groups import DEFAULT_JOBS
from vllm_afd_dev.harness.model_runner import (
    V2_ENV,
    NoModelRunnerV1,
    NoModelRunnerV2MicroBatching,
    model_runner_v1_env,
    model_runner_v2_micro_batching_env,
)

GPU_ENGINE = dict(dtype="bfloat16", attention_backend="FLASH_ATTN")
"""With the memory settings of ``memory_args``."""
# Every decode size up to max_num_seqs is captured, so that eager steps
# (prefill chunks, mixed batches) of a captured total are common.
CAPTURE_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
FULL_DECODE_ONLY = {
    "cudagraph_mode": "FULL_DECODE_ONLY",
    "cudagraph_capture_sizes": CAPTURE_SIZES,
}
SETTINGS = {
    "eager": dict(enforce_eager=True),
    # FULL_DECODE_ONLY over the eager kernels (no torch.compile): both runs
    # execute the same kernels, so bf16 results are bitwise comparable.
    "FULL_DECODE_ONLY": dict(
        enforce_eager=False, compilation_config=dict(FULL_DECODE_ONLY, mode=0)
    ),
    # The default user path: torch.compile (Inductor) plus FULL_DECODE_ONLY.
    "FULL_DECODE_ONLY+compile": dict(enforce_eager=False, compilation_config=FULL_DECODE_ONLY),
}
EAGER_AND_GRAPHS = ["eager", "FULL_DECODE_ONLY"]
"""The settings most tests run each case in."""
# Settings run on Model Runner V1 (its CUDAGraphWrapper path) instead of V2;
# their tests skip on vLLM 0.34 on, which has no V1 (runner_env).
V1_RUNNER = {"FULL_DECODE_ONLY-V1": "FULL_DECODE_ONLY", "eager-V1": "eager"}
# Settings run on Model Runner V2 whatever vLLM would pick for the model
# (VLLM_USE_V2_MODEL_RUNNER=1); the plain settings leave the choice to vLLM.
V2_RUNNER = {"FULL_DECODE_ONLY-V2": "FULL_DECODE_ONLY", "eager-V2": "eager"}


def base_setting(setting: str) -> str:
    """The engine setting of ``setting`` (a key of ``SETTINGS``), less the
    runner it names."""
    return V1_RUNNER.get(setting) or V2_RUNNER.get(setting) or setting


@functools.cache
def memory_plan() -> GpuPlan | None:
    """The GPU memory plan of the test processes sharing this process's GPU
    (``vllm_afd_dev.bench.gpu_memory.gpu_test_plan``): ``AFD_GPU_TEST_GROUPS``
    groups of tests, the tiny checkpoints here; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    groups = int(os.environ.get(TEST_GROUPS_ENV, DEFAULT_JOBS))
    return gpu_test_plan(gpu_total_bytes(), groups, largest_checkpoint_bytes(MODELS))


def memory_args(profiled_kv: bool = False) -> dict:
    """A test engine's memory settings: a fixed KV cache (1 GiB) instead of a
    share of the memory that vLLM profiles, so that several test processes
    can share one GPU without disturbing each other's profiling, and the
    ``gpu_memory_utilization`` of its share of the GPU; ``profiled_kv``: the
    one test engine that lets vLLM size its KV cache from its profile (no
    ``kv_cache_memory_bytes``) gets the plan's spare. Without CUDA, none."""
    plan = memory_plan()
    return {} if plan is None else gpu_test_engine_args(plan, profiled_kv)


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless ``count`` GPUs are visible."""
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} GPUs")


two_gpus = needs_gpus(2)
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl runs one rank per GPU)"
)
# How the roles of a 1A1F deployment sit on the GPUs. The FFN rank takes the
# GPU after the attention ranks' (vllm.afd.ffn.worker.ffn_device_index).
PLACEMENTS = {
    "ipc-1gpu": "ipc",  # both roles on the first visible GPU
    "ipc-2gpu": "ipc",  # attention on GPU 0, the FFN rank on GPU 1, over peer access
    "nccl": "nccl",  # attention on GPU 0, the FFN rank on GPU 1
}
CONNECTORS = [
    "ipc-1gpu",
    pytest.param("ipc-2gpu", marks=needs_two_gpus),
    pytest.param("nccl", marks=needs_two_gpus),
]


def placement_env(placement: str) -> dict[str, str]:
    """The environment that puts both processes where ``placement`` says."""
    if placement == "ipc-1gpu":
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return {"CUDA_VISIBLE_DEVICES": first}
    return {}


def engine(setting: str, mla: bool = False, profiled_kv: bool = False) -> dict:
    """A test engine's arguments for ``setting``; ``profiled_kv``: as ``memory_args``."""
    base = dict(GPU_ENGINE, **memory_args(profiled_kv), **SETTINGS[base_setting(setting)])
    if mla:  # vLLM picks its MLA backend
        del base["attention_backend"]
    return base


MLA_ARCHS = ("deepseek", "kimi_k25", "glm_moe_dsa", "longcat_flash")
"""The tiny checkpoints whose attention is MLA (DeepSeek's, Kimi-K2.5's
language model's, GLM-5's sparse one, LongCat-Flash's two per layer): vLLM
picks the backend."""

# Engine arguments a model needs on the GPU machine, on stock and AFD alike.
ARCH_ENGINE = {
    # On SM90 vLLM picks FlashInfer's GDN prefill, which needs CUTLASS's
    # Python DSL; the GPU kit does not carry it ("SM90 GDN prefill DSL kernel
    # is unavailable"). vLLM's Triton kernels compute the same linear attention.
    "qwen3_next": {"gdn_prefill_backend": "triton"},
    # Qwen3.5-MoE: Qwen3-Next's linear attention, a float32 recurrent state
    # as served, and no multimodal profiling (vLLM 0.26 runs the processor
    # on the image placeholder without an image, which transformers refuses).
    "qwen3_5_moe": {
        "gdn_prefill_backend": "triton",
        "mamba_ssm_cache_dtype": "float32",
        "skip_mm_profiling": True,
    },
    # DeepSeek Sparse Attention is served on its FP8 cache (FlashMLA's sparse
    # kernels; the indexer's DeepGEMM ones): the GPU kit's part `dsa`.
    "deepseek_v32": {"kv_cache_dtype": "fp8"},
    "glm_moe_dsa": {"kv_cache_dtype": "fp8"},
    # DeepSeek-V4: FlashMLA's sparse attention on its FP8 cache, in blocks of
    # 256 (the backend's one size).
    "deepseek_v4": {"kv_cache_dtype": "fp8", "block_size": 256},
    # MiniMax-M3: its sparse layers' cache pages are its sparse blocks (128
    # tokens); vLLM sizes blocks by the first layer's backend, a full
    # attention's (16), and then finds no common size, so M3 is served with
    # `--block-size 128`.
    "minimax_m3": {"block_size": 128},
}


def model_engine(setting: str, arch: str) -> dict:
    """``engine(setting)`` for the tiny checkpoint of ``arch``."""
    return engine(setting, mla=arch.startswith(MLA_ARCHS)) | ARCH_ENGINE.get(arch, {})


def uses_graphs(setting: str) -> bool:
    return not SETTINGS[base_setting(setting)]["enforce_eager"]


def runner_env(setting: str) -> dict[str, str]:
    """The environment of ``setting``'s runner. A V1 setting skips its test
    (its module, called at import) on a vLLM without Model Runner V1."""
    if setting in V2_RUNNER:
        return dict(V2_ENV)
    if setting not in V1_RUNNER:
        return {}
    try:
        return model_runner_v1_env(f"the {setting} setting")
    except NoModelRunnerV1 as e:
        pytest.skip(str(e), allow_module_level=True)


def micro_batching(stages: int) -> dict:
    """Engine arguments of micro-batch overlap in ``stages`` stages, its
    thresholds lowered so that the tests' small batches split."""
    split = {"enable_dbo": True} if stages == 2 else {"ubatch_size": stages}
    return split | {"dbo_decode_token_threshold": stages, "dbo_prefill_token_threshold": 16}


def micro_batching_env(setting: str) -> dict[str, str]:
    """The environment of a micro-batch overlap run in ``setting``: as
    ``runner_env``, but a V2 setting skips its test where Model Runner V2
    cannot micro-batch (vLLM 0.26; patch 0028 from 0.32). Micro-batching
    needs its runner named: up to vLLM 0.33 vLLM picks V1 for it."""
    if setting in V2_RUNNER:
        try:
            return model_runner_v2_micro_batching_env(
                f"micro-batch overlap in the {setting} setting"
            )
        except NoModelRunnerV2MicroBatching as e:
            pytest.skip(str(e))
    return runner_env(setting)


def ffn_cli_args(setting: str, dtype: str = "bfloat16") -> tuple[str, ...]:
    """A hand-started FFN rank's arguments for ``setting`` (spawn_ffn derives
    the same from the attention side's config)."""
    if not uses_graphs(setting):
        return ("--dtype", dtype, "--enforce-eager")
    graphs = {
        k: v
        for k, v in SETTINGS[base_setting(setting)]["compilation_config"].items()
        if k != "cudagraph_capture_sizes"
    }
    return ("--dtype", dtype, "--compilation-config", json.dumps(graphs))


def recording_into(stats_dir: Path | None) -> dict[str, str]:
    """The AFD config entries that make a rank record its step counters into
    ``stats_dir`` at shutdown (none for None)."""
    return {} if stats_dir is None else {"stats_dir": str(stats_dir)}


def graph_steps(stats_dir: Path, who: str) -> GraphStepStats:
    """The graph step counters that ``who`` recorded at shutdown into
    ``stats_dir`` (its AFD config's ``stats_dir``; ``StepRecord``)."""
    try:
        return StepRecord.read(stats_dir, who).graph_steps
    except FileNotFoundError:
        written = sorted(p.name for p in Path(stats_dir).glob("*.json"))
        raise AssertionError(
            f"{who} recorded no step counters in {stats_dir} (records there: {written}): "
            "it did not shut down cleanly, or its AFD config lacks that stats_dir"
        ) from None


def check_step_counters(
    stats_dir: Path,
    setting: str,
    attention_ranks: int = 1,
    ffn_ranks: int = 1,
    step_budget: int = max(CAPTURE_SIZES),
) -> GraphStepStats:
    """Both roles' step counters, as each rank recorded them in ``stats_dir``
    (both roles' AFD ``stats_dir``): each FFN rank ran every step as each of
    its attention peers announced it, and with graphs the replay-rule
    regression happened. vLLM captures the sizes up to ``step_budget`` (the engine's
    max_num_batched_tokens). Returns attention rank 0's counters."""
    for rank in range(attention_ranks):
        ffn_rank = rank // (attention_ranks // ffn_ranks)
        ffn = graph_steps(stats_dir, f"FFN rank {ffn_rank}")
        attention = graph_steps(stats_dir, f"attention rank {rank}")
        print(f"  attention rank {rank}: {attention}\n  its FFN rank {ffn_rank}: {ffn}")
        ran = (attention.captures, attention.replays, attention.eager, attention.micro_batched)
        assert (ffn.captures, ffn.replays, ffn.eager, ffn.micro_batched) == ran
        assert ffn.replays_without_graph == 0
    attention = graph_steps(stats_dir, "attention rank 0")
    if not uses_graphs(setting):
        assert attention.captures == attention.replays == 0
    else:
        # V1 also captures two throw-away graphs while it profiles memory.
        assert attention.captures >= len([s for s in CAPTURE_SIZES if s <= step_budget])
        assert attention.replays > 0
        # The replay-rule regression: real eager steps with the total of a
        # captured decode graph happened, and the FFN ran them eager.
        assert attention.eager_at_graph_size > 0
    return attention
