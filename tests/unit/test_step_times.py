"""Per-step timing of a rank's compute and exchange (``AFDConfig.time_steps``),
with the host clock that CPU ranks use."""

from __future__ import annotations

import time

import pytest
from vllm.distributed.afd_transfer.step_stats import (
    GraphStepStats,
    StepKind,
    StepRecord,
    StepTimeline,
)

LAYOUT = ((4,), (4,))


def timed_step(timeline: StepTimeline, layout, real: bool = True, kind=StepKind.EAGER) -> None:
    timeline.begin_step(layout, kind, real)
    for _ in range(2):  # two layers: compute, then a blocking exchange
        time.sleep(0.01)
        timeline.enter_exchange()
        time.sleep(0.02)
        timeline.leave_exchange()


def test_a_step_splits_into_compute_and_exchange():
    timeline = StepTimeline(on_gpu=False, from_step_start=True)
    for _ in range(3):
        timed_step(timeline, LAYOUT)
    timeline.finish()
    times = timeline.times[(LAYOUT, StepKind.EAGER)]
    compute, exchange = times.per_step()
    assert times.steps == 3
    assert compute == pytest.approx(20, abs=8)
    assert exchange == pytest.approx(40, abs=8)


def test_the_ffn_side_counts_from_its_first_receive():
    timeline = StepTimeline(on_gpu=False, from_step_start=False)
    timeline.begin_step(LAYOUT, StepKind.EAGER, real=True)
    time.sleep(0.03)  # waiting for the attention side's first rows
    timeline.enter_exchange()
    time.sleep(0.01)
    timeline.leave_exchange()
    time.sleep(0.02)  # the FFN
    timeline.enter_exchange()
    timeline.leave_exchange()
    timeline.finish()
    compute, exchange = timeline.times[(LAYOUT, StepKind.EAGER)].per_step()
    assert compute == pytest.approx(20, abs=8)
    assert exchange == pytest.approx(10, abs=8)


def test_only_real_steps_count_and_captures_are_never_read():
    timeline = StepTimeline(on_gpu=False, from_step_start=True)
    timed_step(timeline, LAYOUT, real=False)  # warm-up
    timed_step(timeline, LAYOUT, real=False, kind=StepKind.CAPTURE)
    timed_step(timeline, ((8,),))
    timeline.finish()
    assert list(timeline.times) == [(((8,),), StepKind.EAGER)]


def test_a_rank_records_its_steps_and_times_and_a_reader_gets_them_back(tmp_path):
    """With ``stats_dir`` each rank writes a ``StepRecord`` at shutdown;
    tests and tools read the counters from it, not from log lines."""
    timeline = StepTimeline(on_gpu=False, from_step_start=True)
    timed_step(timeline, LAYOUT)
    timed_step(timeline, ((3, 5),))
    timeline.finish()
    steps = GraphStepStats(captures=2, replays=5, eager=3)
    StepRecord("FFN rank 0", steps, {"0": 16}, timeline.layout_times()).write(tmp_path)
    record = StepRecord.read(tmp_path, "FFN rank 0")
    assert (record.graph_steps, record.tokens) == (steps, {"0": 16})
    read = {t.layout: t for t in record.step_times}
    assert set(read) == {LAYOUT, ((3, 5),)}
    assert read[LAYOUT].steps == 1 and read[LAYOUT].kind == "eager"
    assert read[LAYOUT].exchange_ms == pytest.approx(40, abs=8)
    with pytest.raises(FileNotFoundError, match="attention-rank-0.json"):
        StepRecord.read(tmp_path, "attention rank 0")
