# SPDX-License-Identifier: Apache-2.0
"""The AFD control payload: one small message per forward step.

Each attention rank sends one ``ControlPayload`` to its FFN rank before every
forward it runs (profile, warm-up, capture, eager step, graph replay). The FFN
rank learns from it how many tokens each peer sends in each stage of every
layer, and whether the step is a graph capture or replay. The wire format is a
fixed header plus one uint32 per (stage, peer), so a step costs tens of bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

MAX_STAGES = 4
"""Most overlap stages one step may have: the data planes give every stage of
every layer its own slot (ipc) or message tag (gloo)."""

AFD_PROTOCOL_VERSION = 6
"""Bumped whenever the payload or handshake changes meaning; both roles must
agree (checked by the handshake and by every payload)."""

_MAGIC = b"AFDP"
# magic, protocol version, flags, stages, peers, step id
_HEADER = struct.Struct("<4sHBBHQ")

_FLAG_BITS = {
    "is_warmup": 1 << 0,
    "is_graph_capturing": 1 << 1,
    "is_graph_replaying": 1 << 2,
    "is_profile": 1 << 3,
    "shutdown": 1 << 4,
    "after_failure": 1 << 5,
}


TokenLayout = tuple[tuple[int, ...], ...]
"""A step's token counts, ``layout[stage][peer]`` (``ControlPayload.token_counts``)."""


class PayloadError(ValueError):
    """A control message that this build cannot read."""


@dataclass(frozen=True)
class ControlPayload:
    """What one attention rank tells its FFN rank about one forward step."""

    step_id: int
    """Position of this forward in the attention rank's sequence of forwards,
    starting at 0; the FFN rank checks that it grows by one."""

    token_counts: TokenLayout
    """Tokens per stage and per peer: ``token_counts[stage][peer]`` is how many
    rows attention peer ``peer`` (its index among the FFN rank's peers) sends
    in stage ``stage`` of every layer. Graph steps carry padded counts."""

    is_warmup: bool = False
    """A dummy forward whose outputs are thrown away (compile or capture
    warm-up, idle data-parallel step)."""

    is_graph_capturing: bool = False
    """The attention side captures a CUDA graph for this layout."""

    is_graph_replaying: bool = False
    """The attention side replays a captured CUDA graph for this layout."""

    is_profile: bool = False
    """The attention side's memory-profiling forward."""

    shutdown: bool = False
    """The attention rank is going away; no layers follow."""

    after_failure: bool = False
    """With ``shutdown``: the rank goes away because one of its steps raised
    (for instance a data-parallel collective that lost a peer), not because
    its deployment ended."""

    protocol_version: int = AFD_PROTOCOL_VERSION

    resumes_at_layer: int | None = None
    """Set on the FFN side only, never sent: a replacement FFN rank's first
    step, which it runs eager from this layer (``resume``)."""

    resumes_stages_at: tuple[int, ...] | None = None
    """Set on the FFN side only, never sent: in a replacement's first step,
    micro-batched, the layer each stage runs from."""

    def __post_init__(self) -> None:
        if not self.shutdown and not self.token_counts:
            raise PayloadError("a step payload needs at least one stage")
        if len(self.token_counts) > MAX_STAGES:
            raise PayloadError(
                f"a step has at most {MAX_STAGES} stages, got {len(self.token_counts)}"
            )
        widths = {len(stage) for stage in self.token_counts}
        if len(widths) > 1:
            raise PayloadError(f"every stage must list the same peers, got {self.token_counts}")
        if any(n < 0 for stage in self.token_counts for n in stage):
            raise PayloadError(f"token counts must be >= 0, got {self.token_counts}")

    @property
    def is_real(self) -> bool:
        """A forward that serves requests: no warm-up, profile or capture."""
        return not (self.is_warmup or self.is_profile or self.is_graph_capturing or self.shutdown)

    @classmethod
    def shutdown_message(cls, step_id: int, after_failure: bool = False) -> ControlPayload:
        return cls(step_id=step_id, token_counts=(), shutdown=True, after_failure=after_failure)

    @property
    def num_stages(self) -> int:
        return len(self.token_counts)

    @property
    def num_peers(self) -> int:
        return len(self.token_counts[0]) if self.token_counts else 0

    @property
    def flags(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in _FLAG_BITS}

    def encode(self) -> bytes:
        flags = sum(bit for name, bit in _FLAG_BITS.items() if getattr(self, name))
        header = _HEADER.pack(
            _MAGIC,
            self.protocol_version,
            flags,
            self.num_stages,
            self.num_peers,
            self.step_id,
        )
        counts = [n for stage in self.token_counts for n in stage]
        return header + struct.pack(f"<{len(counts)}I", *counts)

    @classmethod
    def decode(cls, data: bytes) -> ControlPayload:
        if len(data) < _HEADER.size:
            raise PayloadError(f"control message of {len(data)} bytes is too short")
        magic, version, flags, stages, peers, step_id = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise PayloadError(f"not an AFD control message (magic {magic!r})")
        if version != AFD_PROTOCOL_VERSION:
            raise PayloadError(
                f"AFD protocol version {version} from the peer, {AFD_PROTOCOL_VERSION} here: "
                "run the same vLLM-AFD build on both roles"
            )
        expected = _HEADER.size + 4 * stages * peers
        if len(data) != expected:
            raise PayloadError(f"control message is {len(data)} bytes, expected {expected}")
        flat = struct.unpack_from(f"<{stages * peers}I", data, _HEADER.size)
        counts = tuple(tuple(flat[s * peers : (s + 1) * peers]) for s in range(stages))
        return cls(
            step_id=step_id,
            token_counts=counts,
            protocol_version=version,
            **{name: bool(flags & bit) for name, bit in _FLAG_BITS.items()},
        )


def merge_peer_payloads(payloads: list[ControlPayload], expected_step: int) -> ControlPayload:
    """The step that all peers of one FFN rank announced.

    Peers step in lockstep, so every peer must announce the same step id,
    token layout and graph flags; anything else means the roles drifted apart
    and continuing would pair the wrong tensors. Only ``is_warmup`` may
    differ (an idle data-parallel rank runs a dummy batch beside real ones),
    the step is a warm-up when every peer's forward is; and at shutdown
    ``after_failure``, set when any peer's is.
    """
    first = payloads[0]
    for peer, payload in enumerate(payloads):
        if payload.step_id != expected_step:
            raise PayloadError(
                f"attention peer {peer} announced step {payload.step_id}, expected "
                f"{expected_step}: the roles are out of step"
            )
        if replace(payload, is_warmup=first.is_warmup, after_failure=first.after_failure) != first:
            raise PayloadError(
                f"attention peers disagree on step {expected_step}: peer 0 sent {first}, "
                f"peer {peer} sent {payload}"
            )
    if not first.shutdown and first.num_peers != len(payloads):
        raise PayloadError(
            f"step {expected_step} lists {first.num_peers} peers, but this FFN rank "
            f"has {len(payloads)}"
        )
    return replace(
        first,
        is_warmup=all(p.is_warmup for p in payloads),
        after_failure=any(p.after_failure for p in payloads),
    )
