"""Resuming in place (``vllm.distributed.afd_transfer.resume``): where an
attention rank stands, read from its ipc flags, and where a replacement FFN
rank starts.

The last test plays the ipc exchange's flag protocol on the host, as the
connector runs it on the GPU (``IpcSlots``: raise to ``raised(layer)``,
wait until the flag reaches it, lower to ``taken(layer)``; slots by
``exchange_slot``; flags zeroed as each step starts), for two attention
peers and an FFN rank, in random interleavings. The FFN rank is killed after
every possible event; the peers run on until they block; a replacement
starts from ``resume_plan`` of the positions that ``position_from_flags``
reads at some point meanwhile; every peer must then receive each layer's output exactly once, and
computed from its own rows of that layer and step. The same for one peer
whose micro-batched steps run two stages as independent programs, each in
a slot of its own (``position_from_stage_flags``).
"""

from __future__ import annotations

import random

import pytest
from vllm.distributed.afd_transfer.failover import resumed_step
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.resume import (
    PeerPosition,
    StagePosition,
    exchange_slot,
    position_from_flags,
    position_from_stage_flags,
    raised,
    resume_plan,
    taken,
)


@pytest.mark.parametrize("num_layers", range(2, 10))
def test_neighbouring_layers_never_share_a_slot(num_layers):
    slots = [exchange_slot(layer, 0, 1, num_layers) for layer in range(num_layers)]
    # within a step, and from a step's last layer to the next step's first
    neighbours = list(zip(slots, slots[1:] + slots[:1], strict=True))
    assert all(a != b for a, b in neighbours), slots
    assert [exchange_slot(7, stage, 3, num_layers) for stage in range(3)] == [0, 1, 2]


K = 5  # layers: 0, 2 in slot 0; 1, 3 in slot 1; 4 in slot 2
ZERO = [0, 0, 0]


@pytest.mark.parametrize(
    ("to_ffn", "to_attention", "expected"),
    [
        (ZERO, ZERO, PeerPosition(7, 0)),  # the step started, nothing sent
        ([raised(0), 0, 0], ZERO, PeerPosition(7, 0)),
        ([taken(0), 0, 0], ZERO, PeerPosition(7, 0, input_taken=True)),
        ([taken(0), 0, 0], [raised(0), 0, 0], PeerPosition(7, 1)),
        ([taken(0), raised(1), 0], [taken(0), 0, 0], PeerPosition(7, 1)),
        ([taken(2), taken(3), 0], [taken(2), taken(3), 0], PeerPosition(7, 4)),
        ([taken(2), taken(3), taken(4)], [taken(2), taken(3), 0], PeerPosition(7, 4, True)),
        ([taken(2), taken(3), taken(4)], [taken(2), taken(3), raised(4)], PeerPosition(8, 0)),
        # a value in a slot its layer does not use is not an answer
        ([raised(0), 0, 0], [0, raised(0), raised(1)], PeerPosition(7, 0)),
    ],
)
def test_the_position_is_read_from_the_flags(to_ffn, to_attention, expected):
    assert position_from_flags(7, to_ffn, to_attention, K) == expected


def test_the_plan_starts_at_the_peer_furthest_behind():
    # the lost rank answered layer 4 of step 7 to peer 1 only
    plan = resume_plan([PeerPosition(7, 4, input_taken=True), PeerPosition(8, 0)], K)
    assert (plan.step, plan.layer, plan.offsets) == (7, 4, (0, 1))
    assert [plan.rows_kept(p) for p in (0, 1)] == [True, True]
    assert [plan.answered(p) for p in (0, 1)] == [False, True]
    assert plan.runs_from_flags and plan.check_rows((3, 5)) is None

    plain = resume_plan([PeerPosition(9, 0), PeerPosition(9, 0)], K)
    assert not plain.runs_from_flags and plain.check_rows((1, 1)) is None

    apart = resume_plan([PeerPosition(7, 2), PeerPosition(8, 0)], K)
    assert "peers [1] are more than one layer past layer 2" in apart.check_rows((4, 4))
    assert apart.check_rows((4, 0)) is None  # peer 1 sent nothing in step 7


class ExchangeModel:
    """The ipc flag protocol of two attention peers and an FFN rank, one
    event per step of a generator."""

    def __init__(self, counts: list[tuple[int, int]]) -> None:
        self.counts = counts
        """Rows per peer in each step (0: the peer sends none)."""
        self.to_ffn = [[0] * 3 for _ in counts[0]]
        self.to_attention = [[0] * 3 for _ in counts[0]]
        self.in_rows = [[None] * 3 for _ in counts[0]]
        self.out_rows = [[None] * 3 for _ in counts[0]]
        self.step_word = [0 for _ in counts[0]]
        self.received = [[] for _ in counts[0]]

    def attention(self, peer: int):
        for step, counts in enumerate(self.counts):
            self.step_word[peer] = step
            self.to_ffn[peer][:] = self.to_attention[peer][:] = ZERO  # begin_step
            yield
            if not counts[peer]:
                continue
            for layer in range(K):
                slot = exchange_slot(layer, 0, 1, K)
                self.in_rows[peer][slot] = ("in", peer, step, layer)
                self.to_ffn[peer][slot] = raised(layer)
                yield
                while self.to_attention[peer][slot] != raised(layer):
                    yield "blocked"
                self.to_attention[peer][slot] = taken(layer)
                self.received[peer].append(self.out_rows[peer][slot])
                yield

    def ffn(self, first_step: int = 0, plan=None):
        for step in range(first_step, len(self.counts)):
            counts = self.counts[step]
            start = plan.layer if plan is not None and step == plan.step else 0
            for layer in range(start, K):
                resuming = plan is not None and (step, layer) == (plan.step, plan.layer)
                slot = exchange_slot(layer, 0, 1, K)
                rows = {}
                for peer, n in enumerate(counts):
                    if not n:
                        continue
                    if not (resuming and plan.rows_kept(peer)):
                        while self.to_ffn[peer][slot] != raised(layer):
                            yield "blocked"
                        self.to_ffn[peer][slot] = taken(layer)
                        yield
                    rows[peer] = self.in_rows[peer][slot]
                for peer, (_, p, s, layer_) in rows.items():
                    if resuming and plan.answered(peer):
                        continue
                    self.out_rows[peer][slot] = ("out", p, s, layer_)
                    self.to_attention[peer][slot] = raised(layer)
                    yield

    def position(self, peer: int) -> PeerPosition:
        step = self.step_word[peer]
        if not self.counts[step][peer]:
            return PeerPosition(step + 1, 0)
        return position_from_flags(step, self.to_ffn[peer], self.to_attention[peer], K)


def run(programs: dict, rng: random.Random, stop_after: int | None = None) -> int:
    """Step the programs in a random order until all end or block (or
    ``stop_after`` events ran); returns the events run."""
    events = 0
    blocked: set = set()
    while programs and len(blocked) < len(programs):
        name = rng.choice(sorted(set(programs) - blocked, key=str))
        try:
            if next(programs[name]) == "blocked":
                blocked.add(name)
                continue
        except StopIteration:
            del programs[name]
        blocked.clear()
        events += 1
        if stop_after is not None and events >= stop_after:
            break
    return events


def expected(model: ExchangeModel, peer: int) -> list:
    steps = [s for s, counts in enumerate(model.counts) if counts[peer]]
    return [("out", peer, s, layer) for s in steps for layer in range(K)]


COUNTS = [(3, 2), (1, 0), (0, 4), (2, 2)]


def killed_and_replaced(kill_at: int, seed: int, with_plan: bool = True) -> ExchangeModel:
    """The FFN rank killed after ``kill_at`` events; the peers run on, and
    their positions are read at some point before they block (where the
    replacement's handshake falls); a replacement runs from where
    ``resume_plan`` says (or, with ``with_plan`` False, from the start of
    the plan's step)."""
    model, rng = ExchangeModel(COUNTS), random.Random(seed)
    peers = {0: model.attention(0), 1: model.attention(1)}
    run({"ffn": model.ffn(), **peers}, rng, stop_after=kill_at)
    run(dict(peers), rng, stop_after=rng.randint(1, 8))
    plan = resume_plan([model.position(p) for p in (0, 1)], K)
    run(dict(peers), rng)
    if plan.step < len(COUNTS):
        assert plan.check_rows(COUNTS[plan.step]) is None, (kill_at, plan)
    run({"ffn": model.ffn(plan.step, plan if with_plan else None), **peers}, rng)
    return model


def events_of_an_intact_run(seed: int) -> int:
    model = ExchangeModel(COUNTS)
    events = run({"ffn": model.ffn(), 0: model.attention(0), 1: model.attention(1)},
                 random.Random(seed))  # fmt: skip
    assert model.received == [expected(model, 0), expected(model, 1)]
    return events


@pytest.mark.parametrize("seed", range(3))
def test_a_replacement_answers_every_layer_once_wherever_the_loss_falls(seed):
    for kill_at in range(1, events_of_an_intact_run(seed)):
        model = killed_and_replaced(kill_at, seed * 1000 + kill_at)
        assert model.received == [expected(model, 0), expected(model, 1)], kill_at


def test_the_model_fails_without_the_plan():
    """The negative control: a replacement that starts the lost step from
    layer 0, as a redo would, does not give every peer its outputs once."""
    kills = range(1, events_of_an_intact_run(0))
    runs = [killed_and_replaced(k, k, with_plan=False) for k in kills]
    wrong = [m for m in runs if m.received != [expected(m, 0), expected(m, 1)]]
    assert len(wrong) > len(runs) // 4, (len(wrong), len(runs))


# --- micro-batched steps: one peer, each stage in a slot of its own -------------

STAGED = [(3, 2), (1,), (0, 4), (2, 2), (5,), (1, 1)]
"""Rows of the one peer in each stage of each step: micro-batched steps of two
stages (one of them empty once) between one-stage steps."""
SLOTS = 4


@pytest.mark.parametrize(
    ("to_ffn", "to_attention", "sends", "expected"),
    [
        (ZERO, ZERO, [True, True], PeerPosition(7, 0, stages=(StagePosition(0),) * 2)),
        ([taken(2), raised(2), 0], [taken(1), raised(1), 0], [True, True],
         PeerPosition(7, 2, stages=(StagePosition(2, True), StagePosition(2)))),
        # stage 0 answered layer 2 before stage 1 sent it
        ([raised(3), taken(1), 0], [raised(2), taken(1), 0], [True, True],
         PeerPosition(7, 2, stages=(StagePosition(3), StagePosition(2)))),
        # stage 0 is through; stage 1 waits for the last layer
        ([taken(4), taken(4), 0], [taken(4), taken(3), 0], [True, True],
         PeerPosition(7, 4, stages=(StagePosition(5), StagePosition(4, True)))),
        ([taken(4), taken(4), 0], [taken(4), raised(4), 0], [True, True], PeerPosition(8, 0)),
        # a stage without rows does not hold the step
        ([0, taken(4), 0], [0, raised(4), 0], [False, True], PeerPosition(8, 0)),
        ([0, taken(1), 0], [0, taken(0), 0], [False, True],
         PeerPosition(7, 1, stages=(StagePosition(0), StagePosition(1, True)))),
    ],
)  # fmt: skip
def test_a_micro_batched_position_is_read_stage_by_stage(to_ffn, to_attention, sends, expected):
    position = position_from_stage_flags(7, to_ffn, to_attention, K, sends)
    assert position == expected
    assert PeerPosition.from_dict(position.to_dict()) == position  # as it travels


def test_a_position_from_another_peer_is_checked_as_it_travels():
    for stages in ([[1]], [[1, "yes"]], [[-1, False]], [[0, False]] * 5, "stages"):
        with pytest.raises(TypeError, match="stages must be at most 4"):
            PeerPosition.from_dict({"step": 1, "layer": 0, "stages": stages})


class StagedExchangeModel:
    """The ipc flag protocol of one attention peer, whose steps have one or
    two stages (their own slots, ``exchange_slot``), and an FFN rank that
    serves layer by layer, each layer's stages in order; the peer's stages
    run as independent programs within a step, as its micro-batch threads
    do."""

    def __init__(self, counts: list[tuple[int, ...]], rng: random.Random) -> None:
        self.counts, self.rng = counts, rng
        self.to_ffn, self.to_attention = [0] * SLOTS, [0] * SLOTS
        self.in_rows, self.out_rows = [None] * SLOTS, [None] * SLOTS
        self.step_word = 0
        self.received = []

    def _slot(self, step: int, layer: int, stage: int) -> int:
        return exchange_slot(layer, stage, len(self.counts[step]), K)

    def _stage(self, step: int, stage: int):
        for layer in range(K):
            slot = self._slot(step, layer, stage)
            self.in_rows[slot] = ("in", step, stage, layer)
            self.to_ffn[slot] = raised(layer)
            yield
            while self.to_attention[slot] != raised(layer):
                yield "blocked"
            self.to_attention[slot] = taken(layer)
            self.received.append(self.out_rows[slot])
            yield

    def attention(self):
        for step, counts in enumerate(self.counts):
            self.step_word = step
            self.to_ffn[:] = self.to_attention[:] = [0] * SLOTS  # begin_step
            yield
            stages = {s: self._stage(step, s) for s, n in enumerate(counts) if n}
            stuck: set[int] = set()
            while stages:
                ready = sorted(set(stages) - stuck)
                if not ready:
                    yield "blocked"
                    stuck.clear()
                    continue
                stage = self.rng.choice(ready)
                try:
                    if next(stages[stage]) == "blocked":
                        stuck.add(stage)
                        continue
                except StopIteration:
                    del stages[stage]
                stuck.clear()
                yield

    def ffn(self, first_step: int = 0, plan=None):
        for step in range(first_step, len(self.counts)):
            resuming = plan is not None and step == plan.step
            stage_starts = [p.layer for p in plan.stages] if resuming and plan.stages else None
            for layer in range(plan.layer if resuming else 0, K):
                for stage, n in enumerate(self.counts[step]):
                    if not n or (stage_starts and layer < stage_starts[stage]):
                        continue
                    slot = self._slot(step, layer, stage)
                    if not (resuming and plan.rows_kept_at(0, layer, stage)):
                        while self.to_ffn[slot] != raised(layer):
                            yield "blocked"
                        self.to_ffn[slot] = taken(layer)
                        yield
                    _, s, st, layer_ = self.in_rows[slot]
                    if resuming and plan.answered_at(0, layer):
                        continue
                    self.out_rows[slot] = ("out", s, st, layer_)
                    self.to_attention[slot] = raised(layer)
                    yield

    def position(self) -> PeerPosition:
        step, counts = self.step_word, self.counts[self.step_word]
        if len(counts) == 1:
            if not counts[0]:
                return PeerPosition(step + 1, 0)
            return position_from_flags(step, self.to_ffn, self.to_attention, K)
        sends = [n > 0 for n in counts]
        return position_from_stage_flags(step, self.to_ffn, self.to_attention, K, sends)

    def expected(self) -> list:
        return sorted(("out", step, stage, layer) for step, counts in enumerate(self.counts)
                      for stage, n in enumerate(counts) if n for layer in range(K))  # fmt: skip


def staged_killed_and_replaced(kill_at: int, seed: int, with_plan: bool = True):
    rng = random.Random(seed)
    model = StagedExchangeModel(STAGED, rng)
    peer = model.attention()
    run({"ffn": model.ffn(), 0: peer}, rng, stop_after=kill_at)
    run({0: peer}, rng, stop_after=rng.randint(1, 8))
    plan = resume_plan([model.position()], K)
    run({0: peer}, rng)
    if plan.step < len(STAGED):
        step = ControlPayload(plan.step, tuple((n,) for n in STAGED[plan.step]))
        resumed_step(0, plan, step)  # the FFN side accepts the plan
    run({"ffn": model.ffn(plan.step, plan if with_plan else None), 0: peer}, rng)
    return model


def staged_events_of_an_intact_run(seed: int) -> int:
    rng = random.Random(seed)
    model = StagedExchangeModel(STAGED, rng)
    events = run({"ffn": model.ffn(), 0: model.attention()}, rng)
    assert sorted(model.received) == model.expected()
    return events


@pytest.mark.parametrize("seed", range(3))
def test_a_micro_batched_step_resumes_each_stage_once_wherever_the_loss_falls(seed):
    for kill_at in range(1, staged_events_of_an_intact_run(seed)):
        model = staged_killed_and_replaced(kill_at, seed * 1000 + kill_at)
        # every stage of every layer answered once, each from its own rows
        assert len(model.received) == len(model.expected()), kill_at
        assert sorted(model.received) == model.expected(), kill_at


def test_the_staged_model_fails_without_the_plan():
    """The negative control: a replacement that runs every stage of the lost
    step from its first layer, as one plan for one-stage steps would."""
    kills = range(1, staged_events_of_an_intact_run(0))
    runs = [staged_killed_and_replaced(k, k, with_plan=False) for k in kills]
    wrong = [m for m in runs if sorted(m.received) != m.expected()]
    assert len(wrong) > len(runs) // 4, (len(wrong), len(runs))
