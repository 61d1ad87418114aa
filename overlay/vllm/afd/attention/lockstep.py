# SPDX-License-Identifier: Apache-2.0
"""When data-parallel ranks must run every forward together.

Upstream vLLM steps DP ranks in lockstep only for MoE models, whose expert
collectives need every rank in every forward; dense DP ranks run as
independent engines. Under AFD the FFN rank serves all of its attention
peers in each layer, so a dense deployment needs the same lockstep: idle
ranks run dummy batches, and every rank knows every rank's token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.afd import AFDConfig


def dp_lockstep_needed(model_config: ModelConfig, afd_config: AFDConfig | None) -> bool:
    return model_config.is_moe or afd_config is not None


def dp_ranks_step_together(vllm_config: VllmConfig) -> bool:
    """True for MoE models and for every AFD deployment."""
    return dp_lockstep_needed(vllm_config.model_config, vllm_config.afd_config)
