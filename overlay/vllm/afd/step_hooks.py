# SPDX-License-Identifier: Apache-2.0
"""The attention side's model-runner hooks: one control payload per forward.

The model runner calls ``publish_forward_step`` right before every forward
(real steps, profile run, warm-up and capture dummies), inside the forward
context that the forward will use. Without AFD it returns at once.
"""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.afd_transfer import get_afd_connector
from vllm.forward_context import get_forward_context


def publish_forward_step(
    positions: torch.Tensor,
    *,
    is_profile: bool = False,
    is_dummy: bool = False,
    is_graph_capturing: bool = False,
) -> None:
    """Tell the FFN rank about the forward that is about to run."""
    connector = get_afd_connector()
    if connector is None or connector.role != "attention":
        return
    mode = get_forward_context().cudagraph_runtime_mode
    # One stage and one peer: micro-batching (DBO) and several attention
    # ranks per FFN rank add entries here; the payload and FFN loop take any layout.
    connector.publish_step(
        ((positions.shape[-1],),),
        is_warmup=is_dummy and not is_profile,
        is_profile=is_profile,
        is_graph_capturing=is_graph_capturing,
        is_graph_replaying=mode == CUDAGraphMode.FULL and not is_graph_capturing,
    )
