# SPDX-License-Identifier: Apache-2.0
"""Each role endpoint's accounting: its step counters, its timeline and the
figures it reports, in one object per endpoint.

The attention side counts the steps it announced by how they run
(``GraphStepStats``), the tokens it sent and, with ``time_steps``, its
steps' compute and exchange; vLLM's stats path carries those figures to
its /metrics as growths (``AttentionAccounting.stats_to_report``). The FFN
side counts each peer's tokens of real steps and times its steps; its
graph counters live with its graphs (``vllm.afd.ffn.graphs``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

from vllm.distributed.afd_transfer.payload import ControlPayload, TokenLayout
from vllm.distributed.afd_transfer.step_stats import (
    NULL_TIMELINE,
    GraphStepStats,
    NullTimeline,
    StepKind,
    StepRecord,
    StepTimeline,
    StepTimes,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

StepObserver = Callable[[float, float], None]
"""Called with each real step's (compute, exchange) milliseconds."""


def new_timeline(
    enabled: bool, on_gpu: bool, from_step_start: bool, observers: Iterable[StepObserver] = ()
) -> StepTimeline | NullTimeline:
    """A timeline of the real steps (``time_steps``), or one that records nothing."""
    if not enabled:
        return NULL_TIMELINE
    timeline = StepTimeline(on_gpu=on_gpu, from_step_start=from_step_start)
    timeline.observers.extend(observers)
    return timeline


def log_step_stats(
    who: str,
    graph_stats: GraphStepStats,
    timeline: StepTimeline | NullTimeline,
    tokens: dict[str, int],
    stats_dir: str | None,
) -> None:
    """At shutdown: how the steps ran and, with ``time_steps``, their times,
    logged and, with ``stats_dir``, recorded (``StepRecord``)."""
    logger.info(graph_stats.log_line(who))
    timeline.finish()
    for line in timeline.log_lines(who):
        logger.info(line)
    if stats_dir is not None:
        StepRecord(who, graph_stats, tokens, timeline.layout_times()).write(stats_dir)


@dataclasses.dataclass(frozen=True)
class AttentionCounters:
    """What a redone step rolls back to (``AttentionAccounting.snapshot``)."""

    graph_stats: GraphStepStats
    tokens_sent: int


class AttentionAccounting:
    """An attention rank's steps, tokens, times and failovers."""

    def __init__(self, peer_index: int, timeline: StepTimeline | NullTimeline) -> None:
        self._peer_index = peer_index
        self.timeline = timeline
        """With ``time_steps``: each real step's compute and exchange."""
        self.graph_stats = GraphStepStats()
        """The steps announced, by how they run."""
        self._captured_totals: set[int] = set()
        self.tokens_sent = 0
        """Tokens of real steps this rank sent, per layer."""
        self.step_time_totals = StepTimes()
        """With ``time_steps``: the real steps' times, summed."""
        if isinstance(timeline, StepTimeline):
            timeline.observers.append(self.step_time_totals.add)
        self.failovers = 0
        """FFN ranks replaced so far."""
        self.failover_pause_s = 0.0
        """Seconds spent waiting for those replacements, from each loss to
        the replacement's handshake."""
        self._reported: dict[str, float] = {}
        """The figures ``stats_to_report`` has reported."""
        self._report_lock = threading.Lock()

    def count_step(self, payload: ControlPayload) -> None:
        """A step announced: count it and open it on the timeline."""
        if payload.is_real:
            self.tokens_sent += sum(stage[self._peer_index] for stage in payload.token_counts)
        total = sum(map(sum, payload.token_counts))
        if payload.is_graph_capturing:
            kind = StepKind.CAPTURE
            self._captured_totals.add(total)
        elif payload.is_graph_replaying:
            kind = StepKind.REPLAY
        else:
            kind = StepKind.EAGER
            if payload.is_real and total in self._captured_totals:
                self.graph_stats.eager_at_graph_size += 1
        self.graph_stats.count(kind, len(payload.token_counts))
        self.timeline.begin_step(payload.token_counts, kind, payload.is_real)

    def snapshot(self) -> AttentionCounters:
        """The counters as they stand, before a step that may be redone."""
        return AttentionCounters(dataclasses.replace(self.graph_stats), self.tokens_sent)

    def roll_back(self, counters: AttentionCounters) -> None:
        """A step is redone: count it as if it had not run."""
        self.graph_stats, self.tokens_sent = counters.graph_stats, counters.tokens_sent
        self.timeline.abandon_step()

    def count_failover(self, paused_s: float) -> None:
        self.failovers += 1
        self.failover_pause_s += paused_s

    def stats(self) -> dict[str, float]:
        """This rank's AFD figures so far, cumulative, as vLLM's stats path
        carries them to its /metrics (``ModelRunnerOutput.afd_stats``,
        ``vllm/afd/attention/metrics.py``)."""
        steps, times = self.graph_stats, self.step_time_totals
        return {
            "capture_steps": float(steps.captures),
            "replay_steps": float(steps.replays),
            "eager_steps": float(steps.eager),
            "tokens": float(self.tokens_sent),
            "timed_steps": float(times.steps),
            "compute_seconds": times.compute_ms / 1000,
            "exchange_seconds": times.exchange_ms / 1000,
            "failovers": float(self.failovers),
            "failover_pause_seconds": self.failover_pause_s,
        }

    def stats_to_report(self) -> dict[str, float]:
        """How far each figure of ``stats`` grew since the last call, for a
        step's output to carry. vLLM hands a step's stats to one of its API
        servers only, and each adds up what it receives, so every growth is
        reported once. A failover rolls the redone step's figures back; they
        count again only past where they had been."""
        with self._report_lock:
            figures = self.stats()
            reported = self._reported
            self._reported = {f: max(v, reported.get(f, 0.0)) for f, v in figures.items()}
        return {f: max(0.0, v - reported.get(f, 0.0)) for f, v in figures.items()}

    def log_at_shutdown(self, who: str, stats_dir: str | None) -> None:
        tokens = {"sent": self.tokens_sent}
        log_step_stats(who, self.graph_stats, self.timeline, tokens, stats_dir)


class FFNAccounting:
    """An FFN rank's tokens per peer and step times."""

    def __init__(self, peer_ranks: Iterable[int], timeline: StepTimeline | NullTimeline) -> None:
        self.peer_ranks = list(peer_ranks)
        self.timeline = timeline
        """With ``time_steps``: each real step's compute and exchange."""
        self.request_tokens = dict.fromkeys(self.peer_ranks, 0)
        """Tokens of real steps (no warm-up, dummy or profile forward) that
        each attention peer has sent, per layer."""

    def count_step(
        self, payloads: list[ControlPayload] | dict[int, ControlPayload], token_counts: TokenLayout
    ) -> None:
        """A step: its peers' ``payloads`` (in peer order, every peer; or by
        attention rank, the peers in the step), its layout."""
        if isinstance(payloads, list):
            payloads = dict(zip(self.peer_ranks, payloads, strict=True))
        for peer, rank in enumerate(self.peer_ranks):
            payload = payloads.get(rank)
            if payload is None:
                continue
            if not (payload.is_warmup or payload.is_profile or payload.shutdown):
                self.request_tokens[rank] += sum(stage[peer] for stage in token_counts)

    def log_at_shutdown(self, who: str, graph_stats: GraphStepStats, stats_dir: str | None) -> None:
        tokens = {str(rank): n for rank, n in self.request_tokens.items()}
        log_step_stats(who, graph_stats, self.timeline, tokens, stats_dir)
