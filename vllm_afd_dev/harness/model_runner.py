"""Model Runner V1, and V2's micro-batching, on the vLLM these tools run:
whether they are there, and the environment that selects V1 or V2.

Up to vLLM 0.33, ``VLLM_USE_V2_MODEL_RUNNER=0`` runs Model Runner V1, the
runner that AFD's micro-batch overlap ran on first. vLLM 0.34 removed V1 and
refuses that setting (anything but 1 is an error), so the GPU tests and
benchmarks ask for V1 only through ``model_runner_v1_env``, which says what
cannot run instead. ``VLLM_USE_V2_MODEL_RUNNER=1`` runs V2 on every release
(``V2_ENV``), whatever vLLM would pick for the model and features.

Model Runner V2 micro-batches from vLLM 0.30 on (AFD's patch 0028); up to
vLLM 0.33 vLLM picks V1 for micro-batching unless V2 is asked for
(``model_runner_v2_micro_batching_env``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

V1_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
V2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
"""Model Runner V2, on every supported release (0.34 runs nothing else)."""


class NoModelRunnerV1(RuntimeError):
    """Something asked for Model Runner V1 on a vLLM without it."""


class NoModelRunnerV2MicroBatching(RuntimeError):
    """Something asked for Model Runner V2's micro-batching on a vLLM without it."""


def installed_vllm() -> Path:
    """The ``vllm`` package this Python imports (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("this Python finds no vllm package")
    return Path(spec.origin).parent


V1_RUNNER_FILE = Path("v1", "worker", "gpu_model_runner.py")
V2_MICRO_BATCHING_FILE = Path("v1", "worker", "gpu", "ubatch_utils.py")


def _has(vllm_dir: Path | None, part: Path) -> bool:
    """Whether the vLLM at ``vllm_dir`` (default: the one this Python
    imports) has the file ``part``."""
    return ((installed_vllm() if vllm_dir is None else vllm_dir) / part).is_file()


def _env_where(
    vllm_dir: Path | None,
    part: Path,
    env: dict[str, str],
    missing: type[RuntimeError],
    why: Callable[[Path], str],
) -> dict[str, str]:
    """``env`` where the vLLM at ``vllm_dir`` has ``part``; else raises
    ``missing`` saying ``why(vllm_dir)``."""
    vllm_dir = installed_vllm() if vllm_dir is None else vllm_dir
    if not _has(vllm_dir, part):
        raise missing(why(vllm_dir))
    return dict(env)


def has_model_runner_v1(vllm_dir: Path | None = None) -> bool:
    """Whether the vLLM at ``vllm_dir`` (default: the one this Python
    imports) still has Model Runner V1, which vLLM 0.34 removed."""
    return _has(vllm_dir, V1_RUNNER_FILE)


def model_runner_v1_env(what: str, vllm_dir: Path | None = None) -> dict[str, str]:
    """The environment that runs ``what`` on Model Runner V1; raises
    ``NoModelRunnerV1``, naming ``what``, where the vLLM has no V1."""
    return _env_where(vllm_dir, V1_RUNNER_FILE, V1_ENV, NoModelRunnerV1,
                      lambda at: f"{what} runs on Model Runner V1, which the vLLM at {at} "
                      "no longer has (vLLM 0.34 removed it); run it with vLLM 0.33 "
                      "or earlier")  # fmt: skip


def prefer_model_runner_v1(vllm_dir: Path | None = None) -> dict[str, str]:
    """``V1_ENV`` where the vLLM has V1, else nothing (V2 is all it runs)."""
    return dict(V1_ENV) if has_model_runner_v1(vllm_dir) else {}


def has_model_runner_v2_micro_batching(vllm_dir: Path | None = None) -> bool:
    """Whether Model Runner V2 of the vLLM at ``vllm_dir`` (default: the one
    this Python imports) splits steps into micro-batches (vLLM 0.30 on)."""
    return _has(vllm_dir, V2_MICRO_BATCHING_FILE)


def model_runner_v2_micro_batching_env(what: str, vllm_dir: Path | None = None) -> dict[str, str]:
    """The environment that runs ``what`` (micro-batch overlap) on Model
    Runner V2: asked for by name, since up to vLLM 0.33 vLLM picks V1 for
    micro-batching otherwise. Raises ``NoModelRunnerV2MicroBatching``, naming
    ``what``, where V2 cannot micro-batch (vLLM 0.26)."""
    return _env_where(vllm_dir, V2_MICRO_BATCHING_FILE, V2_ENV, NoModelRunnerV2MicroBatching,
                      lambda at: f"{what} runs on Model Runner V2's micro-batching, which the "
                      f"vLLM at {at} does not have (vLLM 0.30 added it); run it with vLLM 0.32 "
                      "or later")  # fmt: skip
