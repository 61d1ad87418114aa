# SPDX-License-Identifier: Apache-2.0
"""Where a lost FFN rank's exchange stood, and where its replacement resumes.

With the ipc connector and ``failover_timeout_s`` an attention rank does not
redo its forward when the FFN rank is lost: its device waits stay blocked,
and the replacement answers the layer in flight (``afd_transfer.failover``'s
in-place failover). That needs each flag to say which layer it belongs to:

* a sender raises a flag to ``raised(layer)``; its receiver waits until the
  flag reaches that value and lowers it to ``taken(layer)``;
* one-stage steps put consecutive layers in different slots
  (``exchange_slot``): a peer one layer ahead of another still holds the
  rows it sent for the layer before, so a replacement can run that layer
  again for every peer, with the same rows as the lost rank had;
* with failover the attention rank zeroes its flags as each forward starts
  and writes the step number beside them, so the flags speak of one step;
* a micro-batched step's stages each have a slot of their own for all
  layers, so a flag's value alone says which layer a stage reached. The
  FFN rank serves layer by layer, each layer's stages in order, so a stage
  stands at most one layer past another; a replacement runs each stage from
  its own layer (``StagePosition``), for the one attention peer it serves.

``position_from_flags`` (``position_from_stage_flags`` for a micro-batched
step) reads an attention rank's position from its flags; ``resume_plan``
turns every peer's position into what the replacement runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.afd_transfer.payload import MAX_STAGES

STEP_MASK = 0x7FFFFFFF
"""The step word holds a step number's low 31 bits (the host maps them back)."""
STEP_WORD_BUSY = 0xFFFFFFFF
"""The step word while a forward's start is zeroing the flags."""
RELEASE = 0x3FFFFFFF
"""What a host stores in a flag to end every wait on it (a lost peer)."""
LAST_LAYER_SLOT = 2
"""One-stage steps use slots 0 and 1 by layer parity, and this one for the
last layer, so that the next step's first layer uses another slot."""


def raised(layer: int) -> int:
    """A flag's value once the rows of ``layer`` are in its slot."""
    return layer + 1


def taken(layer: int) -> int:
    """A flag's value once its receiver took the rows of ``layer`` (as uint32):
    negative, so below every raised value in the waits' cyclic comparison."""
    return (-(layer + 1)) & 0xFFFFFFFF


def exchange_slot(layer: int, stage: int, num_stages: int, num_layers: int) -> int:
    """The slot of one layer and stage: a stage's own with several stages
    (micro-batch overlap), by layer otherwise."""
    if num_stages > 1:
        return stage
    return LAST_LAYER_SLOT if layer == num_layers - 1 else layer % 2


@dataclass(frozen=True)
class StagePosition:
    """How far one stage of a micro-batched step got."""

    layer: int
    """The first layer whose FFN output the stage has not received (0 for a
    stage that sends no rows)."""
    input_taken: bool = False
    """The lost FFN rank had taken the stage's rows of that layer."""


@dataclass(frozen=True)
class PeerPosition:
    """How far one attention rank's exchange got in one step."""

    step: int
    """The step whose forward its GPU is in, counted from the next layer:
    a forward that received its last layer's output is at the next step's
    layer 0."""
    layer: int
    """The first layer whose FFN output it has not received."""
    input_taken: bool = False
    """The lost FFN rank had taken that layer's rows (lowered the flag)."""
    stages: tuple[StagePosition, ...] = ()
    """A micro-batched step: each stage's own position (``layer`` is the
    least of them); empty for a one-stage step."""

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "step": self.step, "layer": self.layer, "input_taken": self.input_taken
        }  # fmt: skip
        if self.stages:
            d["stages"] = [[p.layer, p.input_taken] for p in self.stages]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PeerPosition:
        step, layer, taken_ = d["step"], d["layer"], d.get("input_taken", False)
        if not (_count(step) and _count(layer)):
            raise TypeError("a position's step and layer must be non-negative integers")
        if type(taken_) is not bool:
            raise TypeError("a position's input_taken must be a boolean")
        stages = d.get("stages", [])
        if not (isinstance(stages, list) and len(stages) <= MAX_STAGES and all(
            isinstance(p, list) and len(p) == 2 and _count(p[0]) and type(p[1]) is bool
            for p in stages
        )):  # fmt: skip
            raise TypeError(
                f"a position's stages must be at most {MAX_STAGES} [layer, input_taken] pairs"
            )
        return cls(step, layer, taken_, tuple(StagePosition(*p) for p in stages))


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def position_from_flags(
    step: int, to_ffn: list[int], to_attention: list[int], num_layers: int
) -> PeerPosition:
    """An attention rank's position in one-stage step ``step``, from its
    flags of slots 0..2 (as written since the step's start zeroed them)."""
    answered = [
        layer
        for layer in range(num_layers)
        if to_attention[exchange_slot(layer, 0, 1, num_layers)] in (raised(layer), taken(layer))
    ]
    layer = max(answered) + 1 if answered else 0
    if layer == num_layers:
        return PeerPosition(step + 1, 0)
    slot = exchange_slot(layer, 0, 1, num_layers)
    return PeerPosition(step, layer, to_ffn[slot] == taken(layer))


def position_from_stage_flags(
    step: int, to_ffn: list[int], to_attention: list[int], num_layers: int, sends: list[bool]
) -> PeerPosition:
    """An attention rank's position in micro-batched step ``step``, from its
    flags of slots 0..(stages - 1) (one slot a stage, ``exchange_slot``);
    ``sends[stage]``: whether the rank sends rows in that stage."""
    stages = []
    for stage, sending in enumerate(sends):
        answered = [layer for layer in range(num_layers)
                    if to_attention[stage] in (raised(layer), taken(layer))]  # fmt: skip
        layer = answered[0] + 1 if sending and answered else 0
        done = sending and layer == num_layers
        stages.append(StagePosition(layer, sending and not done and to_ffn[stage] == taken(layer)))
    unanswered = [p.layer for p, sending in zip(stages, sends, strict=True)
                  if sending and p.layer < num_layers]  # fmt: skip
    if not unanswered:
        return PeerPosition(step + 1, 0)
    return PeerPosition(step, min(unanswered), stages=tuple(stages))


@dataclass(frozen=True)
class ResumePlan:
    """What a replacement FFN rank runs first."""

    step: int
    """The step it runs first (from ``layer``); its peers announce it again."""
    layer: int
    offsets: tuple[int, ...]
    """Per peer: how many layers past (``step``, ``layer``) it stands."""
    inputs_taken: tuple[bool, ...]
    """Per peer at the start: the lost rank took its rows of ``layer``."""
    stages: tuple[StagePosition, ...] = ()
    """A micro-batched step of one peer: where each of its stages resumes."""

    def rows_kept(self, peer: int) -> bool:
        """The peer's rows of ``layer`` are in their slot, its flag lowered:
        read them without waiting."""
        return self.offsets[peer] == 1 or self.inputs_taken[peer]

    def answered(self, peer: int) -> bool:
        """The peer has ``layer``'s output already: send it none."""
        return self.offsets[peer] > 0

    def rows_kept_at(self, peer: int, layer: int, stage: int) -> bool:
        """The peer's rows of this layer and stage are in their slot, its
        flag lowered by the lost rank: read them without waiting."""
        if self.stages:
            return (layer, True) == (self.stages[stage].layer, self.stages[stage].input_taken)
        return layer == self.layer and self.rows_kept(peer)

    def answered_at(self, peer: int, layer: int) -> bool:
        """The peer has this layer's output already: send it none. (A
        micro-batched step's answered stages are not run at all.)"""
        return not self.stages and layer == self.layer and self.answered(peer)

    @property
    def runs_from_flags(self) -> bool:
        """Whether the step must run eager from ``layer`` (anything but a
        plain step from its start)."""
        return (self.layer > 0 or any(self.offsets) or any(self.inputs_taken)
                or any(p.layer or p.input_taken for p in self.stages))  # fmt: skip

    def check_rows(self, token_counts: tuple[int, ...]) -> str | None:
        """Why the step, with these rows per peer, cannot resume; None if it can.
        A peer more than one layer ahead holds none of its rows of ``layer``,
        which is fine only if it sent none."""
        behind = [p for p, n in enumerate(token_counts) if n and self.offsets[p] > 1]
        if not behind:
            return None
        return (
            f"attention peers {behind} are more than one layer past layer {self.layer} of "
            f"step {self.step}, where the others stand, so their rows of that layer are gone"
        )


def resume_plan(positions: list[PeerPosition], num_layers: int) -> ResumePlan:
    """The plan for peers at ``positions`` (peer order)."""
    start = min(positions, key=lambda p: (p.step, p.layer))

    def offset(p: PeerPosition) -> int:
        return (p.step - start.step) * num_layers + p.layer - start.layer

    offsets = tuple(offset(p) for p in positions)
    taken_ = tuple(o == 0 and p.input_taken for o, p in zip(offsets, positions, strict=True))
    # Several peers' micro-batched steps do not resume (``failover.resumed_step``).
    stages = positions[0].stages if len(positions) == 1 else ()
    return ResumePlan(start.step, start.layer, offsets, taken_, stages)
