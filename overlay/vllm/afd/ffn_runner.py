# SPDX-License-Identifier: Apache-2.0
"""The FFN role's model runner: FFN weights, no KV cache, no sampler.

``serve`` is the daemon loop. Each control payload starts one step; for
every layer and every stage it receives the hidden states of all peers,
concatenates them, runs the FFN once, splits the result and sends each peer
its slice. On a GPU the step is captured, replayed or run eager as the
``FFNGraphCache`` decides from the payload. It returns when every peer has
sent shutdown. In an FFN rank of several processes (``FFNGroup``) only the
leader has a connector; the others run the same layers on the rows it shares.
"""

from __future__ import annotations

import time

import torch
from vllm.afd.ffn_graphs import FFNGraphCache
from vllm.afd.ffn_group import FFNGroup
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.step_stats import NULL_TIMELINE, NullTimeline, StepTimeline
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model

logger = init_logger(__name__)


class FFNModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device, group: FFNGroup) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.group = group
        self.model = None
        self.steps = 0
        """Steps served, profile and warm-up forwards included."""
        graphs = vllm_config.compilation_config.cudagraph_mode
        self.graphs = FFNGraphCache(
            enabled=device.type == "cuda"
            and graphs is not None
            and graphs.has_full_cudagraphs()
            and not vllm_config.model_config.enforce_eager,
            device=device,
        )

    def load_model(self) -> None:
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            # The loader builds vllm.afd.models.ffn_model.FFNModel for the FFN role.
            self.model = get_model(vllm_config=self.vllm_config)
        logger.info(
            "AFD FFN weights loaded (group rank %d of %d): the FFN of %d layers, %d bytes "
            "(read %d bytes of the checkpoint), in %.1f s",
            self.group.rank,
            self.group.size,
            self.model.num_layers,
            self.model.weight_bytes,
            self.model.checkpoint_bytes_read,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def execute_step(self, connector: AFDConnectorBase | None, step: ControlPayload) -> None:
        timeline = connector.timeline if connector is not None else NULL_TIMELINE
        self.graphs.run(step, lambda: self._forward(connector, step, timeline), timeline)
        self.steps += 1

    def _forward(
        self,
        connector: AFDConnectorBase | None,
        step: ControlPayload,
        timeline: StepTimeline | NullTimeline,
    ) -> None:
        """One step's layers; ``connector`` is None on a group's followers."""
        num_tokens = sum(sum(stage) for stage in step.token_counts)
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            for layer in range(self.model.num_layers):
                for stage, counts in enumerate(step.token_counts):
                    if not any(counts):
                        continue
                    timeline.enter_exchange()
                    rows = None
                    if connector is not None:
                        rows = torch.cat(connector.recv_hidden_states(layer, stage, counts))
                    rows = self.group.share_rows(rows, sum(counts))
                    timeline.leave_exchange()
                    output = self.model(layer, rows)
                    if connector is None:
                        continue
                    timeline.enter_exchange()
                    connector.send_ffn_output(list(output.split(counts)), layer, stage)
                    timeline.leave_exchange()

    def serve(self, connector: AFDConnectorBase | None) -> None:
        """Run steps until every attention peer has shut down. A group's
        followers pass no connector and take the leader's steps."""
        while True:
            step = self.group.share_step(connector.next_step() if connector else None)
            if step.shutdown:
                self._log_shutdown(connector)
                return
            self.execute_step(connector, step)

    def _log_shutdown(self, connector: AFDConnectorBase | None) -> None:
        if connector is not None:
            logger.info(
                "AFD FFN rank %d: shutdown after %d steps; request tokens per attention rank: %s",
                connector.rank,
                self.steps,
                connector.request_tokens,
            )
            connector.log_step_stats(f"FFN rank {connector.rank}", self.graphs.stats)
        else:
            logger.info(
                "AFD FFN group rank %d: shutdown after %d steps", self.group.rank, self.steps
            )
        if self.device.type == "cuda":
            logger.info(
                "AFD FFN group rank %d of %d on %s: peak device memory %.1f MiB (its share of "
                "the FFN weights, activations, transfer buffers; no attention, no KV cache)",
                self.group.rank,
                self.group.size,
                self.device,
                torch.cuda.max_memory_allocated(self.device) / 2**20,
            )
