"""The FFN graph key, the replay rule and the capture-order checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.afd.attention.step_hooks import CaptureSequence
from vllm.afd.ffn.graphs import CaptureOrderError, FFNGraphCache
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.step_stats import GraphStepStats, StepKind, StepTimeline


def step(counts, step_id: int = 0, **flags) -> ControlPayload:
    """A payload; step 0 is the first of an FFN rank that did not replace one."""
    return ControlPayload(step_id=step_id, token_counts=counts, **flags)


def cache_with(*keys) -> FFNGraphCache:
    """A cache that holds graphs for ``keys`` (the graph objects are not run)."""
    cache = FFNGraphCache(enabled=True)
    cache.graphs.update(dict.fromkeys(keys, object()))
    return cache


DECODE_4_4 = ((4, 4),)


@pytest.mark.parametrize(
    "captured, payload, expected",
    [
        # the attention side replays a layout the FFN captured: replay
        ([DECODE_4_4], step(DECODE_4_4, is_graph_replaying=True), StepKind.REPLAY),
        # same total, other split (chunked prefill 7 + 1 run eager): eager
        ([DECODE_4_4], step(((7, 1),)), StepKind.EAGER),
        # same split, but the attention side runs it eager: eager
        ([DECODE_4_4], step(DECODE_4_4), StepKind.EAGER),
        # a replay whose split the FFN never captured, even with that total: eager
        ([DECODE_4_4], step(((7, 1),), is_graph_replaying=True), StepKind.EAGER),
        # one peer, total equal to a captured decode size, eager prefill: eager
        ([((8,),)], step(((8,),)), StepKind.EAGER),
        # per stage: the same counts in another stage order are another layout
        ([((4,), (2,))], step(((2,), (4,)), is_graph_replaying=True), StepKind.EAGER),
        ([((4,), (2,))], step(((4,), (2,)), is_graph_replaying=True), StepKind.REPLAY),
        # warm-ups and profile runs are eager even when a graph exists
        ([DECODE_4_4], step(DECODE_4_4, is_warmup=True), StepKind.EAGER),
        ([DECODE_4_4], step(DECODE_4_4, is_profile=True), StepKind.EAGER),
    ],
)
def test_replay_only_when_the_attention_side_replays_that_exact_layout(captured, payload, expected):
    assert cache_with(*captured).decide(payload) is expected


def test_a_replay_without_a_graph_runs_eager_and_is_counted(caplog):
    cache = cache_with(DECODE_4_4)
    ran = []
    for _ in range(3):
        kind = cache.run(step(((7, 1),), is_graph_replaying=True), lambda: ran.append(1))
        assert kind is StepKind.EAGER
    assert len(ran) == 3
    assert cache.stats == GraphStepStats(
        eager=3, replays_without_graph=3, peer_split_at_graph_total=3
    )


def test_a_replacement_captures_replayed_layouts_after_one_eager_run():
    """A replacement FFN rank (its first step is not step 0) sees replays of
    layouts captured before it joined: the first of each runs eager, as a
    warm-up, the next is captured and replayed. A rank that started with the
    deployment never does that: for it a replay without a graph is a fault."""
    replacement, original = FFNGraphCache(enabled=True), FFNGraphCache(enabled=True)
    replacement.decide(step(((5, 3),), step_id=57))
    original.decide(step(((5, 3),), step_id=0))
    replay = step(DECODE_4_4, step_id=58, is_graph_replaying=True)
    assert [replacement.decide(replay) for _ in range(3)] == [
        StepKind.EAGER, StepKind.REPLAY, StepKind.REPLAY
    ]  # fmt: skip
    assert replacement.stats.replays_without_graph == 0
    assert [original.decide(replay) for _ in range(3)] == [StepKind.EAGER] * 3
    assert original.stats.replays_without_graph == 3
    # Eager steps of a replacement stay eager; an eager deployment never captures.
    assert replacement.decide(step(((2, 2),), step_id=59)) is StepKind.EAGER
    eager = FFNGraphCache(enabled=False)
    eager.decide(step(((5, 3),), step_id=57))
    assert [eager.decide(replay) for _ in range(2)] == [StepKind.EAGER] * 2


def test_a_replacements_replays_of_a_layout_it_captured_late_are_timed(monkeypatch):
    """``time_steps``: the step that captures a layout while serving is timed
    as a capture, so the graph keeps its exchange marks and the replays after
    it count. The stand-in graph (CUDA graphs need a GPU) replays what a
    CUDA graph does here: it records again the marks taken in its capture."""
    timeline = StepTimeline(on_gpu=False, from_step_start=False)
    cache = FFNGraphCache(enabled=True)

    def capture(key, forward):
        forward()
        marks = timeline._captured.get(key, [])
        cache.graphs[key] = SimpleNamespace(replay=lambda: [m.record() for m in marks])

    monkeypatch.setattr(cache, "_capture", capture)

    def forward():
        timeline.enter_exchange()
        timeline.leave_exchange()

    cache.run(step(((5, 3),), step_id=57), forward, timeline)
    replay = step(DECODE_4_4, step_id=58, is_graph_replaying=True)
    for _ in range(4):  # eager, captured and replayed, replayed twice
        cache.run(replay, forward, timeline)
    timeline.finish()
    assert cache.stats.late_captures == 1
    assert timeline.times[DECODE_4_4, StepKind.REPLAY].steps == 2


def test_a_standby_captures_in_advance_then_replays_without_capturing_while_serving(
    monkeypatch,
):
    """A standby's first steps are its own warm-ups and captures of the
    layouts the served rank offered (``FFNModelRunner.rehearse``, all step
    0); after it takes over, replays of those layouts replay at once, and a
    layout it was not offered is captured while serving, as by any
    replacement. It offers its own layouts to the next standby once it
    serves. The stand-in capture records the layout (CUDA graphs need a GPU)."""
    served = FFNGraphCache(enabled=True)
    standby = FFNGraphCache(enabled=True, standby=True)
    ran = []

    def stand_in_capture(cache: FFNGraphCache):
        def capture(key, forward):
            cache.graphs[key] = SimpleNamespace(replay=lambda: ran.append("replay"))

        return capture

    for cache in (served, standby):
        monkeypatch.setattr(cache, "_capture", stand_in_capture(cache))
    for key in (DECODE_4_4, ((1, 1),)):
        served.run(step(key, is_warmup=True), lambda: None)
        served.run(step(key, is_graph_capturing=True), lambda: None)
    assert served.layouts_for_standby() is None  # captures may follow
    served.run(step(((7, 1),), step_id=9), lambda: None)
    offered = served.layouts_for_standby()
    assert offered == [DECODE_4_4, ((1, 1),)]

    for key in offered:
        standby.run(step(key, is_warmup=True), lambda: ran.append("warm-up"))
        standby.run(step(key, is_graph_capturing=True), lambda: ran.append("forward"))
    assert ran == ["warm-up", "warm-up"] and standby.layouts_for_standby() is None
    replay = step(DECODE_4_4, step_id=57, is_graph_replaying=True)
    assert standby.run(replay, lambda: ran.append("eager")) is StepKind.REPLAY
    assert ran[-1] == "replay"
    other = step(((2, 2),), step_id=58, is_graph_replaying=True)
    kinds = [standby.run(other, lambda: ran.append("eager")) for _ in range(2)]
    assert kinds == [StepKind.EAGER, StepKind.REPLAY]  # captured at its second replay
    assert standby.stats.late_captures == 1 and standby.stats.replays_without_graph == 0
    assert standby.layouts_for_standby() == [DECODE_4_4, ((1, 1),), ((2, 2),)]


def test_other_peer_splits_of_a_captured_total_are_counted():
    cache = cache_with(DECODE_4_4, ((1,),))
    cache.decide(step(((7, 1),)))  # counted: a split no graph has, total 8
    cache.decide(step(((7, 1),), is_graph_replaying=True))  # counted, and a missing graph
    cache.decide(step(((6, 1),)))  # total 7: no graph of that total
    cache.decide(step(DECODE_4_4))  # the captured split itself, run eager
    cache.decide(step(((7, 1),), is_warmup=True))  # not a real step
    cache.decide(step(((1,),)))  # one peer: a total is one split
    assert cache.stats.peer_split_at_graph_total == 2
    assert cache.stats.replays_without_graph == 1


def test_capture_follows_a_warm_up_of_the_same_layout():
    cache = FFNGraphCache(enabled=True)
    assert cache.decide(step(DECODE_4_4, is_warmup=True)) is StepKind.EAGER
    assert cache.decide(step(DECODE_4_4, is_graph_capturing=True)) is StepKind.CAPTURE


@pytest.mark.parametrize(
    "before",
    [
        [],  # no warm-up at all
        [step(((2, 2),), is_warmup=True)],  # warm-up of another layout
        [step(DECODE_4_4, is_warmup=True), step(DECODE_4_4)],  # a real step in between
    ],
)
def test_capture_order_drift_is_an_error(before):
    cache = FFNGraphCache(enabled=True)
    for payload in before:
        cache.decide(payload)
    with pytest.raises(CaptureOrderError, match="not preceded by a warm-up"):
        cache.decide(step(DECODE_4_4, is_graph_capturing=True))


def test_capture_on_an_eager_ffn_rank_is_an_error():
    cache = FFNGraphCache(enabled=False)
    cache.decide(step(DECODE_4_4, is_warmup=True))
    with pytest.raises(CaptureOrderError, match="same cudagraph mode"):
        cache.decide(step(DECODE_4_4, is_graph_capturing=True))


def test_attention_capture_sequence_follows_native_order():
    seq = CaptureSequence([8, 4, 1])
    for n in (8, 4, 1):
        seq.check(n, capturing=False)
        seq.check(n, capturing=True)
    seq.finish()


@pytest.mark.parametrize(
    "ran, message",
    [
        ([(8, True)], "ran a capture forward of 8 tokens where the AFD hooks expected a warm-up"),
        (
            [(4, False)],
            "ran a warm-up forward of 4 tokens where the AFD hooks expected a warm-up of 8",
        ),
        ([(8, False), (8, False)], "expected a capture of 8"),
    ],
)
def test_attention_capture_sequence_drift_is_an_error(ran, message):
    seq = CaptureSequence([8, 4])
    with pytest.raises(CaptureOrderError, match=message):
        for n, capturing in ran:
            seq.check(n, capturing)


def test_attention_capture_sequence_must_be_complete():
    seq = CaptureSequence([8, 4])
    seq.check(8, capturing=False)
    seq.check(8, capturing=True)
    with pytest.raises(CaptureOrderError, match=r"still expected: \[\('warm-up', '4'\)"):
        seq.finish()
    extra = CaptureSequence([])
    with pytest.raises(CaptureOrderError, match="after the last FULL descriptor"):
        extra.check(1, capturing=False)


def test_micro_batched_steps_are_counted_beside_their_kind():
    cache = FFNGraphCache(enabled=False)
    cache.run(step(((4,), (4,))), lambda: None)  # a dual-batch-overlap step
    cache.run(step(((8,),)), lambda: None)
    assert (cache.stats.eager, cache.stats.micro_batched) == (2, 1)


def test_stats_log_line_names_every_counter():
    stats = GraphStepStats(
        captures=3, replays=17, eager=9, replays_without_graph=1, micro_batched=4
    )
    line = stats.log_line("FFN rank 0")
    assert line.startswith("AFD graph steps of FFN rank 0: captures=3 replays=17 eager=9")
    assert "replays_without_graph=1" in line and "micro_batched=4" in line
