# SPDX-License-Identifier: Apache-2.0
"""Which of vLLM's model runners a config runs on, across the releases AFD
supports.

Up to vLLM 0.33 a GPU or CPU worker runs Model Runner V1 or V2, as
``VllmConfig.use_v2_model_runner`` decides (``VLLM_USE_V2_MODEL_RUNNER``,
then the model and features). vLLM 0.34 removed V1 and that property with
it: every worker runs V2, on the CPU as its ``CPUModelRunner`` (a subclass
of V2's runner), except on a CPU other than x86 without Triton, where it
runs ``StandaloneCPUModelRunner``, a runner of its own that AFD's patches
do not reach.

Model Runner V2 micro-batches from vLLM 0.30 on (``v1/worker/gpu/ubatch_utils.py``);
vLLM 0.26's V2 runs every step whole.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def has_model_runner_v1() -> bool:
    """Whether this vLLM still has Model Runner V1: its ``VllmConfig`` class
    decides between V1 and V2 (``use_v2_model_runner``, gone in 0.34). Read
    from the class, not a config: the property weighs the whole config."""
    from vllm.config import VllmConfig

    return inspect.getattr_static(VllmConfig, "use_v2_model_runner", None) is not None


def runs_model_runner_v2(vllm_config: VllmConfig) -> bool:
    """Whether this vLLM runs ``vllm_config``'s model on Model Runner V2:
    always where it has no V1 (0.34 on), else as the config decides."""
    if not has_model_runner_v1():
        return True
    return bool(vllm_config.use_v2_model_runner)


def model_runner_v2_micro_batches() -> bool:
    """Whether this vLLM's Model Runner V2 can split a step into micro-batches
    (its ``ubatch_utils`` module, vLLM 0.30 on). Read from the tree, not
    imported: the module pulls in V2's runner, which needs Triton."""
    import vllm

    return (Path(vllm.__file__).parent / "v1" / "worker" / "gpu" / "ubatch_utils.py").is_file()


def cpu_runner_without_afd_hooks() -> str | None:
    """The CPU model runner this vLLM picks on this machine if AFD's patches
    do not reach it (``StandaloneCPUModelRunner``, vLLM 0.34 on a CPU other
    than x86 without Triton), else None."""
    from vllm.platforms import current_platform

    standalone = getattr(current_platform, "uses_standalone_cpu_model_runner", None)
    if standalone is not None and standalone():
        return "StandaloneCPUModelRunner"
    return None
