# SPDX-License-Identifier: Apache-2.0
"""What each rank records about its steps: how they ran, and where their time went.

``GraphStepStats`` counts steps by how they ran (captured, replayed, eager).
The attention side counts what it announced, the FFN side what it did; over
one run the two must agree, which the tests check from each rank's
``StepRecord`` (written at shutdown with ``AFDConfig.stats_dir``).

``StepTimeline`` (``AFDConfig.time_steps``, for benchmarks) splits each real
step of a rank into its own **compute** and its **exchange**: the time its
stream spent inside data-plane calls, transfers plus waiting for the peer.
It marks the stream at the start of the step and on entering and leaving each
data-plane call: CUDA events on GPUs (external ones, so that graphs capture
them and every replay records them again), the host clock on CPU, where the
transfers are synchronous. On the attention side a step runs from its start
(embedding and the first attention are its work) to the last layer's FFN
output (the final norm, logits and sampler run after it and do not overlap
the FFN either way); on the FFN side from its first receive (before it, the
FFN only waits for its peers' first rows) to its last send.

Reading the events of a replayed graph must happen before that graph replays
again, so each step's times are read when the next step begins: a host wait
for the previous step's last mark. That wait is why timing is off by default.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

StepLayout = tuple[tuple[int, ...], ...]
"""A step's token layout, ``layout[stage][peer]``: the payload's token counts."""


class StepKind(enum.Enum):
    CAPTURE = "capture"
    REPLAY = "replay"
    EAGER = "eager"


@dataclass
class GraphStepStats:
    """How the steps of one rank ran."""

    captures: int = 0
    replays: int = 0
    eager: int = 0
    replays_without_graph: int = 0
    """FFN side: the attention side replayed a layout this rank had no graph
    for, so the FFN ran that step eager (counted in ``eager`` as well)."""
    eager_at_graph_size: int = 0
    """Attention side: real eager steps (chunked prefills, mixed batches)
    whose total token count equals that of a captured graph. An FFN that
    keyed its graphs by the total would wrongly replay these."""
    peer_split_at_graph_total: int = 0
    """FFN side, several peers: real steps whose total equals a captured
    layout's but whose split over the peers matches no captured layout (a
    prefill of 7 + 1 beside a graph of 4 + 4). A graph keyed by the total
    would replay these with rows sent to the wrong peers."""
    micro_batched: int = 0
    """Steps split into several overlap stages (each also counted as capture,
    replay or eager)."""
    late_captures: int = 0
    """FFN side, a replacement FFN rank: graphs it captured while serving,
    for layouts the attention side had captured before it joined (each such
    step also counted as a replay)."""

    def count(self, kind: StepKind, stages: int = 1) -> None:
        name = {StepKind.CAPTURE: "captures", StepKind.REPLAY: "replays"}.get(kind, "eager")
        setattr(self, name, getattr(self, name) + 1)
        self.micro_batched += stages > 1

    def log_line(self, who: str) -> str:
        values = " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"AFD graph steps of {who}: {values}"


@dataclass
class StepTimes:
    """Summed times of the real steps of one layout and kind."""

    steps: int = 0
    compute_ms: float = 0.0
    """The rank's own work: the step's span less its exchange."""
    exchange_ms: float = 0.0
    """Inside data-plane calls: transfers, and waiting for the peer."""

    def add(self, compute_ms: float, exchange_ms: float) -> None:
        self.steps += 1
        self.compute_ms += compute_ms
        self.exchange_ms += exchange_ms

    def per_step(self) -> tuple[float, float]:
        """Mean (compute, exchange) milliseconds per step."""
        return self.compute_ms / self.steps, self.exchange_ms / self.steps


class _HostMark:
    """A CPU mark: the work before it has finished when it is taken."""

    __slots__ = ("t",)

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _HostMark) -> float:
        return 1000 * (later.t - self.t)


def _cuda_mark():
    import torch

    return torch.cuda.Event(enable_timing=True, external=True)


class StepTimeline:
    """One rank's marks, step by step (see the module docstring)."""

    def __init__(self, on_gpu: bool, from_step_start: bool) -> None:
        self._new_mark = _cuda_mark if on_gpu else _HostMark
        self._from_step_start = from_step_start
        """Whether the work before the first exchange belongs to the step
        (attention side) or is only a wait for the peers (FFN side)."""
        self.times: dict[tuple[StepLayout, StepKind], StepTimes] = {}
        self.observers: list[Callable[[float, float], None]] = []
        """Called with each real step's (compute, exchange) milliseconds
        (the FFN rank's /metrics histograms)."""
        self._captured: dict[StepLayout, list] = {}
        """The exchange marks baked into each captured graph."""
        self._open: tuple[StepLayout, StepKind, bool] | None = None
        self._start = None
        self._marks: list = []

    def _mark(self):
        mark = self._new_mark()
        mark.record()
        return mark

    def begin_step(self, layout: StepLayout, kind: StepKind, real: bool) -> None:
        """Before the step's forward (or replay) is launched. ``real``: not a
        warm-up, profile or capture forward, so its times count."""
        self._close_step()
        self._open = (layout, kind, real)
        if kind is StepKind.REPLAY:
            # The graph records the exchange marks it was captured with.
            self._marks = self._captured.get(layout, [])
        else:
            self._marks = []
            if kind is StepKind.CAPTURE:
                self._captured[layout] = self._marks
        self._start = self._mark()

    def enter_exchange(self) -> None:
        if self._open is not None and self._open[1] is not StepKind.REPLAY:
            self._marks.append(self._mark())

    # Entering and leaving mark alike: the marks pair up in order.
    leave_exchange = enter_exchange

    def _close_step(self) -> None:
        if self._open is None:
            return
        layout, kind, real = self._open
        self._open = None
        if not real or kind is StepKind.CAPTURE or not self._marks:
            return
        self._marks[-1].synchronize()
        first = self._start if self._from_step_start else self._marks[0]
        span = first.elapsed_time(self._marks[-1])
        pairs = zip(self._marks[0::2], self._marks[1::2], strict=True)
        exchange = sum(enter.elapsed_time(leave) for enter, leave in pairs)
        self.times.setdefault((layout, kind), StepTimes()).add(span - exchange, exchange)
        for observe in self.observers:
            observe(span - exchange, exchange)

    def finish(self) -> None:
        """Read the last step (at shutdown)."""
        self._close_step()

    def abandon_step(self) -> None:
        """Forget the open step: its peer was lost in it, and it runs again."""
        self._open = None

    def layout_times(self) -> list[LayoutTimes]:
        """The mean times of each layout and kind timed so far."""
        found = []
        for (layout, kind), t in sorted(self.times.items(), key=lambda item: str(item[0])):
            compute, exchange = t.per_step()
            found.append(LayoutTimes(layout, kind.value, t.steps, compute, exchange))
        return found

    def log_lines(self, who: str) -> list[str]:
        return [t.log_line(who) for t in self.layout_times()]


class NullTimeline:
    """Stands in for ``StepTimeline`` when timing is off: records nothing."""

    def begin_step(self, layout: StepLayout, kind: StepKind, real: bool) -> None:
        pass

    def enter_exchange(self) -> None:
        pass

    leave_exchange = enter_exchange

    def finish(self) -> None:
        pass

    def abandon_step(self) -> None:
        pass

    def layout_times(self) -> list[LayoutTimes]:
        return []

    def log_lines(self, who: str) -> list[str]:
        return []


NULL_TIMELINE = NullTimeline()


def _layout_text(layout: StepLayout) -> str:
    return "/".join("+".join(map(str, stage)) for stage in layout)


@dataclass(frozen=True)
class LayoutTimes:
    """The mean times of one rank's real steps of one layout and kind."""

    layout: StepLayout
    kind: str
    steps: int
    compute_ms: float
    exchange_ms: float

    def log_line(self, who: str) -> str:
        return (
            f"AFD step times of {who}: layout={_layout_text(self.layout)} kind={self.kind} "
            f"steps={self.steps} compute_ms={self.compute_ms:.4f} "
            f"exchange_ms={self.exchange_ms:.4f}"
        )


@dataclass(frozen=True)
class StepRecord:
    """What one rank writes at shutdown into ``AFDConfig.stats_dir``: how its
    steps ran, the tokens of its real steps (an attention rank's ``sent``;
    an FFN rank's by attention rank) and, with ``time_steps``, its times."""

    who: str
    """``"attention rank N"`` or ``"FFN rank N"``."""
    graph_steps: GraphStepStats
    tokens: dict[str, int]
    step_times: list[LayoutTimes]

    @staticmethod
    def path(directory: str | Path, who: str) -> Path:
        return Path(directory) / f"{who.lower().replace(' ', '-')}.json"

    def write(self, directory: str | Path) -> None:
        path = self.path(directory, self.who)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, directory: str | Path, who: str) -> StepRecord:
        """The record ``who`` wrote into ``directory``; ``FileNotFoundError``
        naming it if none was written (the rank did not shut down cleanly)."""
        data = json.loads(cls.path(directory, who).read_text())
        return cls(
            who=data["who"],
            graph_steps=GraphStepStats(**data["graph_steps"]),
            tokens=data["tokens"],
            step_times=[
                LayoutTimes(**{**t, "layout": tuple(map(tuple, t["layout"]))})
                for t in data["step_times"]
            ],
        )
