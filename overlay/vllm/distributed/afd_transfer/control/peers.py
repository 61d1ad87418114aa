# SPDX-License-Identifier: Apache-2.0
"""FFN side: the places of attention ranks that are deployments of their own.

Attention ranks started as separate deployments (``AFDConfig.attention_rank``)
do not step in lockstep: each announces its own forwards, with its own step
count, and its payload lists its own tokens only (the other peers' columns
are 0). The FFN rank serves whichever of them have a step ready, in one FFN
call per layer: ``PeerPlaces`` keeps, per place (attention rank), whether it
is served, has finished (its shutdown message) or was lost, the step it
announces next, and the payload it has announced and that has not been
served yet; ``next_step`` merges the ready payloads into one step.

A lost place stays open for a restarted rank (``rejoin``), which starts its
step count again from its hello. Nothing here touches a socket or a tensor,
so the bookkeeping is tested on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from vllm.distributed.afd_transfer.payload import ControlPayload, PayloadError

SERVED, FINISHED, LOST = "served", "finished", "lost"


def _kind(payload: ControlPayload) -> tuple:
    """What payloads must share to run as one FFN step: their stages and
    every flag (a warm-up, profile, capture or replay runs apart from real
    steps, so that each step's transfer bound and graph decision are
    those of all its peers)."""
    return (
        payload.num_stages,
        payload.is_warmup,
        payload.is_profile,
        payload.is_graph_capturing,
        payload.is_graph_replaying,
    )


@dataclass
class _Place:
    state: str = SERVED
    next_step: int = 0
    pending: tuple[int, ControlPayload] | None = None
    """(arrival order, payload): announced, not served yet."""


class PeerPlaces:
    """One FFN rank's attention ranks of their own, by place."""

    def __init__(self, peer_ranks: list[int], resume_steps: dict[int, int] | None = None) -> None:
        self.peer_ranks = list(peer_ranks)
        resume_steps = resume_steps or {}
        self._places = {rank: _Place(next_step=resume_steps.get(rank, 0)) for rank in peer_ranks}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------- queries
    def state(self, rank: int) -> str:
        return self._places[rank].state

    def ranks_in(self, state: str) -> list[int]:
        return [rank for rank, place in self._places.items() if place.state == state]

    @property
    def served(self) -> list[int]:
        return self.ranks_in(SERVED)

    @property
    def lost(self) -> list[int]:
        return self.ranks_in(LOST)

    def waiting_to_announce(self) -> list[int]:
        """Served places whose next payload is still to be read."""
        return [rank for rank in self.served if self._places[rank].pending is None]

    def all_finished(self) -> bool:
        return all(place.state == FINISHED for place in self._places.values())

    def next_step_of(self, rank: int) -> int:
        return self._places[rank].next_step

    # ------------------------------------------------------------ changes
    def announce(self, rank: int, payload: ControlPayload) -> None:
        """The payload that served place ``rank`` sent: a shutdown finishes
        the place, a step waits to be served. Raises ``PayloadError`` for a
        step out of order or one that lists another peer's tokens."""
        place = self._places[rank]
        if place.state != SERVED or place.pending is not None:
            raise PayloadError(f"attention rank {rank} announced a step it may not ({place})")
        if payload.shutdown:
            place.state = FINISHED
            return
        if payload.step_id != place.next_step:
            raise PayloadError(
                f"attention rank {rank} announced step {payload.step_id}, expected "
                f"{place.next_step}: the roles are out of step"
            )
        index = self.peer_ranks.index(rank)
        if payload.num_peers != len(self.peer_ranks) or any(
            n for stage in payload.token_counts for p, n in enumerate(stage) if p != index
        ):
            raise PayloadError(
                f"attention rank {rank}, a deployment of its own, must announce its own tokens "
                f"only, as peer {index} of {len(self.peer_ranks)}: got {payload.token_counts}"
            )
        place.pending = (next(self._arrivals), payload)

    def lose(self, rank: int) -> None:
        """The place's rank is gone: what it announced is not served."""
        place = self._places[rank]
        place.state, place.pending = LOST, None

    def rejoin(self, rank: int, resume_step: int = 0) -> None:
        """A rank takes a place that is not served back (a restart: its
        step count starts at its hello's ``resume_step``)."""
        place = self._places[rank]
        if place.state == SERVED:
            raise ValueError(f"attention rank {rank} is served already")
        self._places[rank] = _Place(next_step=resume_step)

    def next_step(self, step_id: int) -> tuple[ControlPayload, dict[int, ControlPayload]] | None:
        """The step to serve next, numbered ``step_id``: every waiting
        payload of the same kind as the one that waits longest, merged
        (each peer's column from its own payload), and those payloads by
        rank; None while none waits."""
        waiting = {rank: p.pending for rank, p in self._places.items() if p.pending is not None}
        if not waiting:
            return None
        _, first = min(waiting.values(), key=lambda pending: pending[0])
        kind = _kind(first)
        group = {rank: payload for rank, (_, payload) in waiting.items() if _kind(payload) == kind}
        width = len(self.peer_ranks)
        counts = tuple(
            tuple(sum(p.token_counts[stage][peer] for p in group.values()) for peer in range(width))
            for stage in range(first.num_stages)
        )
        for rank in group:
            place = self._places[rank]
            place.pending = None
            place.next_step += 1
        return dataclasses.replace(first, step_id=step_id, token_counts=counts), group
