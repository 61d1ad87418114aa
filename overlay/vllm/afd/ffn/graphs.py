# SPDX-License-Identifier: Apache-2.0
"""The FFN rank's CUDA graphs: one per exact token layout.

The attention side decides when a step is a graph: it captures FULL decode
graphs and replays one only for a uniform decode batch of a captured size.
The FFN side follows, never guesses:

* it captures when the payload says the attention side captures, for the
  layout in that payload;
* it replays only when the payload says the attention side replays *and* a
  graph for that exact layout exists;
* everything else runs eager. A chunked prefill of 7 + 1 tokens from two
  peers has the same total as a decode of 4 + 4, but its rows belong to other
  peers: a graph keyed by the total would send peer 0's rows to peer 1.

A replacement FFN rank (failover) joins after the attention side captured
its graphs, so it sees replays of layouts it never captured. It captures
each such layout while serving: the first replay of it runs eager, which
warms the layout up as vLLM does before a capture, and the next one is
captured and then replayed, with that step's rows. It knows itself a
replacement from its first step, which is not step 0. A standby on ipc
needs none of that: once the rank it backs serves, it maps the same peers'
buffers and captures the layouts that rank has graphs for
(``layouts_for_standby``, ``FFNModelRunner.rehearse``) before any loss.
Where a replacement resumes a step in the middle (ipc), that step runs
eager.

Captures run inside vLLM's ``graph_capture`` context, as vLLM's own runners
capture: in an FFN rank of several processes the graphs hold the group's
all-reduces, and vLLM's custom all-reduce registers its graph buffers as the
context ends. Every process of the group captures the same layouts in the
same order, since each decides from the same payload.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.distributed.afd_transfer.payload import ControlPayload, TokenLayout
from vllm.distributed.afd_transfer.step_stats import (
    NULL_TIMELINE,
    GraphStepStats,
    NullTimeline,
    StepKind,
    StepTimeline,
)
from vllm.distributed.parallel_state import graph_capture
from vllm.logger import init_logger

logger = init_logger(__name__)

GraphKey = TokenLayout
"""A graph's key: the token layout of the steps it runs."""


def _total(key: GraphKey) -> int:
    return sum(map(sum, key))


class CaptureOrderError(RuntimeError):
    """The roles disagree about the sequence of capture forwards."""


class FFNGraphCache:
    """One ``torch.cuda.CUDAGraph`` per exact layout, in this rank's own pool."""

    def __init__(
        self, enabled: bool, device: torch.device | None = None, standby: bool = False
    ) -> None:
        self.enabled = enabled
        """False when the deployment runs eager (``enforce_eager``)."""
        self.device = device
        """The GPU this rank captures on (needed when ``enabled``)."""
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._serving = False
        """Whether a real step has run (the attention side's captures are over)."""
        self.stats = GraphStepStats()
        self._pool = None
        self._last_warmup: GraphKey | None = None
        self._warned_missing = False
        self._replacement: bool | None = True if standby else None
        """Whether this rank took a lost one's place: known at its first
        step, or from the start for a standby (whose first steps are its
        own captures in advance, ``FFNModelRunner.rehearse``)."""
        self._warmed_late: set[GraphKey] = set()
        """A replacement's layouts that ran eager once at a replay."""

    def layouts_for_standby(self) -> list[GraphKey] | None:
        """The layouts this rank serves in graphs, for a standby to capture
        in advance; None until the attention side's captures are over (its
        first real step). Safe to call from another thread: ``list`` copies
        the dict's keys (tuples) without a thread switch."""
        return list(self.graphs) if self._serving else None

    def decide(self, step: ControlPayload) -> StepKind:
        """How this rank runs ``step``; checks the capture order."""
        key = step.token_counts
        if self._replacement is None:
            self._replacement = step.step_id > 0
        if step.is_graph_capturing:
            if not self.enabled:
                raise CaptureOrderError(
                    f"the attention side captures a graph for {key}, but this FFN rank runs "
                    "eager; start both roles with the same cudagraph mode"
                )
            # vLLM warms each layout up eagerly right before capturing it; a
            # capture without that warm-up means the roles' step sequences drifted.
            if self._last_warmup != key:
                raise CaptureOrderError(
                    f"capture of layout {key} was not preceded by a warm-up of the same layout "
                    f"(last warm-up: {self._last_warmup}); the attention side's capture loop "
                    "no longer matches the AFD hooks (check the V1/V2 runner patches)"
                )
            self._last_warmup = None
            return StepKind.CAPTURE
        self._last_warmup = key if step.is_warmup else None
        if step.resumes_at_layer is not None:
            return StepKind.EAGER  # part of a step, as the lost rank left it
        if step.is_graph_replaying and key in self.graphs:
            return StepKind.REPLAY
        if step.is_graph_replaying and self.enabled and self._replacement:
            if key in self._warmed_late:
                return StepKind.REPLAY  # captured first, in run
            self._warmed_late.add(key)
            return StepKind.EAGER
        if step.is_real and len(key[0]) > 1 and key not in self.graphs:
            self.stats.peer_split_at_graph_total += _total(key) in map(_total, self.graphs)
        if step.is_graph_replaying:
            self.stats.replays_without_graph += 1
            if not self._warned_missing:
                self._warned_missing = True
                logger.warning(
                    "AFD FFN: the attention side replays a graph for layout %s, which this "
                    "rank never captured; running it eager (warned once, counted in the stats)",
                    key,
                )
        return StepKind.EAGER

    def run(
        self,
        step: ControlPayload,
        forward: Callable[[], None],
        timeline: StepTimeline | NullTimeline = NULL_TIMELINE,
    ) -> StepKind:
        """Run ``forward`` (the step's layers) as ``decide`` says."""
        kind = self.decide(step)
        key = step.token_counts
        self._serving |= step.is_real
        # A replacement's layout, warmed up before, is captured now: timed as
        # a capture, so that its exchange marks are kept for its replays.
        late = kind is StepKind.REPLAY and key not in self.graphs
        timeline.begin_step(key, StepKind.CAPTURE if late else kind, step.is_real)
        if kind is StepKind.CAPTURE:
            self._capture(key, forward)
        elif kind is StepKind.REPLAY:
            if late:
                logger.info("AFD FFN: capturing layout %s while serving (this rank "
                            "replaced a lost one)", key)  # fmt: skip
                self._capture(key, forward)
                self.stats.late_captures += 1
            self.graphs[key].replay()
        else:
            forward()
        self.stats.count(kind, len(step.token_counts))
        return kind

    def _capture(self, key: GraphKey, forward: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with (
            graph_capture(self.device) as context,
            torch.cuda.graph(graph, pool=self._pool, stream=context.stream),
        ):
            forward()
        self.graphs[key] = graph
