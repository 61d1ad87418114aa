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
  and writes the step number beside them, so the flags speak of one step.

``position_from_flags`` reads an attention rank's position from its flags;
``resume_plan`` turns every peer's position into what the replacement runs.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    (micro-batch overlap, which failover refuses), by layer otherwise."""
    if num_stages > 1:
        return stage
    return LAST_LAYER_SLOT if layer == num_layers - 1 else layer % 2


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

    def to_dict(self) -> dict[str, int | bool]:
        return {"step": self.step, "layer": self.layer, "input_taken": self.input_taken}

    @classmethod
    def from_dict(cls, d: dict) -> PeerPosition:
        step, layer, taken_ = d["step"], d["layer"], d.get("input_taken", False)
        if not (type(step) is int and type(layer) is int and step >= 0 and layer >= 0):
            raise TypeError("a position's step and layer must be non-negative integers")
        if type(taken_) is not bool:
            raise TypeError("a position's input_taken must be a boolean")
        return cls(step, layer, taken_)


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

    def rows_kept(self, peer: int) -> bool:
        """The peer's rows of ``layer`` are in their slot, its flag lowered:
        read them without waiting."""
        return self.offsets[peer] == 1 or self.inputs_taken[peer]

    def answered(self, peer: int) -> bool:
        """The peer has ``layer``'s output already: send it none."""
        return self.offsets[peer] > 0

    @property
    def runs_from_flags(self) -> bool:
        """Whether the step must run eager from ``layer`` (anything but a
        plain step from its start)."""
        return self.layer > 0 or any(self.offsets) or any(self.inputs_taken)

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
    return ResumePlan(start.step, start.layer, offsets, taken_)
