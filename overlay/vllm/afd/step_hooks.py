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
from vllm.forward_context import DPMetadata, get_forward_context


def peer_token_counts(
    peer_ranks: list[int], num_tokens: int, dp_metadata: DPMetadata | None
) -> tuple[int, ...]:
    """How many tokens each attention peer of this rank's FFN rank sends.

    With one peer that is this forward's own count. With several, the peers
    are data-parallel ranks stepping in lockstep, and the forward context
    carries every rank's count (``vllm/afd/lockstep.py`` turns that on).
    """
    if len(peer_ranks) == 1:
        return (num_tokens,)
    if dp_metadata is None:
        raise RuntimeError(
            f"AFD attention peers {peer_ranks} share an FFN rank, but this forward has no "
            "data-parallel token counts; the attention ranks must run as the "
            "data-parallel ranks of one deployment (data_parallel_size = num_attention_ranks)"
        )
    counts = dp_metadata.num_tokens_across_dp_cpu.tolist()
    return tuple(int(counts[rank]) for rank in peer_ranks)


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
    context = get_forward_context()
    mode = context.cudagraph_runtime_mode
    # One stage: micro-batching (DBO) adds entries here; the payload and the
    # FFN loop take any layout.
    connector.publish_step(
        (peer_token_counts(connector.peer_ranks, positions.shape[-1], context.dp_metadata),),
        is_warmup=is_dummy and not is_profile,
        is_profile=is_profile,
        is_graph_capturing=is_graph_capturing,
        is_graph_replaying=mode == CUDAGraphMode.FULL and not is_graph_capturing,
    )
