# SPDX-License-Identifier: Apache-2.0
"""An FFN rank that spans several devices (``ffn_tensor_parallel_size`` > 1).

The processes of one FFN rank form vLLM's tensor-parallel group, so the FFN
layers split themselves as in a colocated deployment of that size: a dense
MLP by columns and rows, MoE experts by their intermediate size or, with
``ffn_enable_expert_parallel``, whole experts per process. Every process
runs every layer on the same rows, and the layers' own reductions leave the
whole output on each of them.

Only the group's leader (group rank 0) holds the connector; the attention
side sees one FFN rank. The leader hands the others each step's control
payload (through the group's shared-memory message queue, where a follower
may wait as long as the deployment idles) and each layer's rows (an
all-reduce over the group, bounded by the step). The leader alone sends the
output back. Every collective goes through vLLM's device communicator, so a
captured step holds them all (``FFNGraphCache``).
"""

from __future__ import annotations

import torch
from vllm.distributed import get_tp_group
from vllm.distributed.afd_transfer.payload import ControlPayload


class FFNGroup:
    """One process's place in its FFN rank's group."""

    def __init__(
        self, size: int, rank: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.size = size
        self.rank = rank
        self.width = width
        """Row width: hidden size, plus the router logits when the gate runs
        on the attention side."""
        self.dtype = dtype
        self.device = device

    @property
    def is_leader(self) -> bool:
        """The process that holds the connector and talks to the attention side."""
        return self.rank == 0

    def share_step(self, step: ControlPayload | None) -> ControlPayload:
        """The leader's step payload, on every process of the group."""
        if self.size == 1:
            assert step is not None
            return step
        queue = get_tp_group().mq_broadcaster
        if self.is_leader:
            queue.enqueue(step)
            return step
        # An idle deployment sends no steps for as long as it idles.
        return queue.dequeue(indefinite=True)

    def share_rows(self, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor:
        """The rows the leader received for one layer and stage, on every
        process of the group."""
        if self.size == 1:
            assert rows is not None
            return rows
        # The leader's rows plus zeros from the others, exact in every dtype:
        # an all-reduce, which vLLM's communicators (custom all-reduce,
        # pynccl) run inside CUDA graphs, where the group's broadcast (plain
        # torch.distributed) is not meant to be captured.
        if not self.is_leader:
            rows = torch.zeros(num_rows, self.width, dtype=self.dtype, device=self.device)
        return get_tp_group().all_reduce(rows)
