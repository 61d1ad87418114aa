# SPDX-License-Identifier: Apache-2.0
"""The FFN role's model runner: FFN weights, no KV cache, no sampler.

``serve`` is the daemon loop. Each control payload starts one step; for
every layer and every stage it receives the hidden states of all peers,
concatenates them, runs the FFN once, splits the result and sends each peer
its slice. On a GPU the step is captured, replayed or run eager as the
``FFNGraphCache`` decides from the payload. It returns when every peer has
sent shutdown. In an FFN rank of several processes (``FFNGroup``) only the
leader has an endpoint; the others run the same layers on the rows it shares.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from vllm.afd.ffn.graphs import FFNGraphCache, GraphKey
from vllm.afd.ffn.group import FFNGroup
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.step_stats import NULL_TIMELINE, NullTimeline, StepTimeline
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.afd_connector.base import AFDDataPlane
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint

logger = init_logger(__name__)


class FFNModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device, group: FFNGroup) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.group = group
        self.model = None
        self.steps = 0
        """Steps run: profile and warm-up forwards, and a standby's captures
        in advance, included."""
        graphs = vllm_config.compilation_config.cudagraph_mode
        self.graphs = FFNGraphCache(
            enabled=device.type == "cuda"
            and graphs is not None
            and graphs.has_full_cudagraphs()
            and not vllm_config.model_config.enforce_eager,
            device=device,
            standby=vllm_config.afd_config.standby,
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
    def execute_step(
        self,
        data_plane: AFDDataPlane | NoPeers | None,
        step: ControlPayload,
        timeline: StepTimeline | NullTimeline = NULL_TIMELINE,
    ) -> None:
        self.graphs.run(step, lambda: self._forward(data_plane, step, timeline), timeline)
        self.steps += 1

    def rehearse(self, endpoint: FFNEndpoint, layouts: list[GraphKey]) -> None:
        """A standby, before it takes over: capture a graph of each layout
        the served rank has graphs for, against the peers' memory mapped in
        advance (``FFNEndpoint.prepare_standby``), after an eager
        warm-up of it as vLLM warms up before a capture. The warm-up runs on
        zero rows and sends nothing (``NoPeers``): the peers' buffers and
        flags are in use by the rank being backed, and a capture only
        records. The group's other processes take the same steps."""
        start = time.perf_counter()
        spec = endpoint.spec
        no_peers = NoPeers(spec.input_width, spec.dtype, self.device)
        for i, key in enumerate(layouts):
            warmup = ControlPayload(step_id=0, token_counts=key, is_warmup=True)
            capture = dataclasses.replace(warmup, is_warmup=False, is_graph_capturing=True)
            self.execute_step(no_peers, self.group.share_step(warmup))
            self.execute_step(endpoint.data_plane, self.group.share_step(capture),
                              endpoint.timeline)  # fmt: skip
            logger.debug("AFD FFN standby: captured layout %s (%d of %d)", key, i + 1,
                         len(layouts))  # fmt: skip
        logger.info(
            "AFD FFN standby: captured the graphs of %d layouts in advance in %.1f s",
            len(layouts),
            time.perf_counter() - start,
        )

    def _forward(
        self,
        data_plane: AFDDataPlane | NoPeers | None,
        step: ControlPayload,
        timeline: StepTimeline | NullTimeline,
    ) -> None:
        """One step's layers (a resumed step's from where it resumes);
        ``data_plane`` is None on a group's followers."""
        num_tokens = sum(sum(stage) for stage in step.token_counts)
        # A resumed micro-batched step runs each stage from its own layer.
        starts = step.resumes_stages_at or (0,) * step.num_stages
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            for layer in range(step.resumes_at_layer or 0, self.model.num_layers):
                for stage, counts in enumerate(step.token_counts):
                    if not any(counts) or layer < starts[stage]:
                        continue
                    timeline.enter_exchange()
                    rows = None
                    if data_plane is not None:
                        rows = torch.cat(data_plane.recv_hidden_states(layer, stage, counts))
                    rows = self.group.share_rows(rows, sum(counts))
                    timeline.leave_exchange()
                    output = self.model(layer, rows, stage)
                    if data_plane is None:
                        continue
                    timeline.enter_exchange()
                    data_plane.send_ffn_output(list(output.split(counts)), layer, stage)
                    timeline.leave_exchange()

    def serve(self, endpoint: FFNEndpoint | None) -> None:
        """Run steps until every attention peer has shut down. A group's
        followers pass no endpoint and take the leader's steps."""
        while True:
            step = self.group.share_step(endpoint.next_step() if endpoint else None)
            if step.shutdown:
                self._log_shutdown(endpoint)
                return
            if endpoint is None:
                self.execute_step(None, step)
            else:
                self.execute_step(endpoint.data_plane, step, endpoint.timeline)

    def _log_shutdown(self, endpoint: FFNEndpoint | None) -> None:
        if endpoint is not None:
            logger.info(
                "AFD FFN rank %d: shutdown after %d steps; request tokens per attention rank: %s",
                endpoint.rank,
                self.steps,
                endpoint.accounting.request_tokens,
            )
            endpoint.log_at_shutdown(self.graphs.stats)
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


class NoPeers:
    """Stands in for the data plane in a standby's warm-up forwards: zero
    rows in, nothing out (``FFNModelRunner.rehearse``)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.width, self.dtype, self.device = width, dtype, device

    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        return [torch.zeros(n, self.width, dtype=self.dtype, device=self.device)
                for n in token_counts]  # fmt: skip

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        pass
