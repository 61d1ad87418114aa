# SPDX-License-Identifier: Apache-2.0
"""The data-plane interface that every AFD connector implements.

A data plane carries one FFN rank's rows: per layer and stage, the hidden
states of each attention peer to the FFN rank, and its output back. The
gloo, nccl and ipc connectors implement ``AFDDataPlane``; a data plane
whose memory the attention rank owns, so that a forward in flight outlives
a lost FFN rank, implements ``InPlaceDataPlane`` beside it (ipc). Everything
else (rendezvous, handshake, one control payload per step, failover and
accounting) belongs to the role endpoints above (``afd_transfer.endpoint``),
which own a data plane each: like vLLM's KV-connector base, this is an
interface, and the logic lives in each connector.

Attention rank ``a`` belongs to FFN rank ``a // (A/F)``, where it is peer
``a % (A/F)``. On the FFN side, lists of tensors are in peer order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.afd import AFDConfig
    from vllm.distributed.afd_transfer.payload import TokenLayout
    from vllm.distributed.afd_transfer.resume import PeerPosition, ResumePlan


@dataclass(frozen=True)
class ExchangeShape:
    """What the model tells the data plane about its exchanges."""

    input_width: int
    """Columns of the rows sent to the FFN rank (hidden states, plus router
    logits when the gate runs on the attention side)."""
    num_layers: int
    """Exchanges per forward: one per decoder layer, or per part of one
    (LongCat-Flash: two per decoder layer)."""


@dataclass(frozen=True)
class DataPlaneSpec:
    """What one rank's data plane is built for."""

    afd_config: AFDConfig
    role: str
    """``"attention"`` or ``"ffn"``."""
    rank: int
    """Attention rank (role "attention") or FFN rank (role "ffn")."""
    ffn_rank: int
    peer_ranks: tuple[int, ...]
    """The attention ranks served by ``ffn_rank``, in peer order."""
    num_layers: int
    """Exchanges per forward (``ExchangeShape.num_layers``)."""
    input_width: int
    """Columns of the rows sent to the FFN rank (hidden states, plus router
    logits when the gate runs on the attention side)."""
    output_width: int
    """Columns of the FFN output rows."""
    dtype: torch.dtype
    max_rows: int
    """Rows of a step at most (``max_num_batched_tokens``)."""

    @classmethod
    def of(cls, vllm_config: VllmConfig, rank: int, shape: ExchangeShape) -> DataPlaneSpec:
        afd = vllm_config.afd_config
        assert afd is not None, "AFD data planes need VllmConfig.afd_config"
        ffn_rank = afd.ffn_rank_of(rank) if afd.role == "attention" else rank
        model = vllm_config.model_config
        return cls(
            afd_config=afd,
            role=afd.role,
            rank=rank,
            ffn_rank=ffn_rank,
            peer_ranks=tuple(afd.attention_ranks_of(ffn_rank)),
            num_layers=shape.num_layers,
            input_width=shape.input_width,
            output_width=model.get_hidden_size(),
            dtype=model.dtype,
            max_rows=vllm_config.scheduler_config.max_num_batched_tokens,
        )

    @property
    def host(self) -> str:
        return self.afd_config.host

    @property
    def peer_index(self) -> int:
        """Attention side: this rank's index among its FFN rank's peers."""
        return self.peer_ranks.index(self.rank)

    @property
    def group_size(self) -> int:
        """Ranks in the FFN rank's data-plane group: the FFN rank and its peers."""
        return 1 + len(self.peer_ranks)

    @property
    def group_rank(self) -> int:
        """Rank in that group: the FFN rank is 0, peer p is p + 1."""
        return 0 if self.role == "ffn" else 1 + self.peer_index


@dataclass
class StepExchange:
    """What the endpoint tells its data plane about the step in flight."""

    stages: int = 1
    """Stages of the step announced (attention) or received (FFN) last."""
    transfer_timeout_s: float | None = None
    """Bound on each transfer of the step: ``timeout_s`` in real steps; None
    (as long as the peer lives) in the forwards before serving, where a peer
    may compile its model for as long as it takes."""
    local_address: str = ""
    """This rank's own address towards its peers: the FFN rank's ``host``;
    on an attention rank the local end of its control connection (on
    another node, the address of the interface that reaches ``host``)."""
    step_id: int = 0
    """The step announced (attention) or received (FFN) last."""
    resuming: ResumePlan | None = None
    """FFN side, a replacement's first step: its resume plan, until the
    next step comes (``FFNEndpoint.next_step``; gloo lets it go as soon as
    the layer it resumes at is answered)."""
    resume_after_loss: Callable[[int, int], PeerPosition] | None = None
    """Attention side, failing over in place on the host
    (``failover.HostInPlaceFailover``): called by a data plane whose
    transfer of (step, layer) found the FFN rank lost; returns once a
    replacement has joined, with where it resumes. None: a lost FFN rank
    fails the transfer."""
    describe_lost_ffn_rank: Callable[[float], str] = field(default=lambda wait_s: "")
    """Attention side: what to say of a lost FFN rank, waiting up to the
    given seconds for its stop notice (``AttentionEndpoint``)."""

    def resuming_at(self, layer: int) -> ResumePlan | None:
        """The resume plan if ``layer`` is the one a replacement's first step
        resumes at; else None."""
        resume = self.resuming
        return resume if resume is not None and resume.layer == layer else None


class AFDDataPlane(ABC):
    """One rank's end of an FFN rank's data plane."""

    device_waits: bool = False
    """True for data planes whose transfers wait on the device (stream memory
    operations, NCCL kernels): a lost peer would leave the GPU waiting
    forever, so losing one releases those waits (``abort``)."""

    def __init__(self, spec: DataPlaneSpec, exchange: StepExchange) -> None:
        self.spec = spec
        self.exchange = exchange

    # ---------------------------------------------------------------- set-up
    def device_facts(self) -> dict[str, Any]:
        """Attention side: what the FFN rank must know about this rank's
        device to join it (sent in the hello)."""
        return {}

    def check_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        """FFN side: why this data plane cannot join the peers whose
        ``device_facts`` these are (by attention rank); empty if it can."""
        return []

    @abstractmethod
    def serve(self) -> dict[str, Any]:
        """FFN side, before the handshake reply: open what the peers join.
        The returned dict reaches every peer's ``join``."""

    @abstractmethod
    def join(self, data_plane: dict[str, Any]) -> None:
        """Both sides, after a successful handshake."""

    # ------------------------------------------------------------- transfers
    @abstractmethod
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        """Attention side: hand one layer's normed hidden states to the FFN."""

    @abstractmethod
    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        """Attention side: fill ``out`` with the FFN output for that layer."""

    @abstractmethod
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        """FFN side: one tensor per peer, ``token_counts[peer]`` rows each."""

    @abstractmethod
    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        """FFN side: send each peer its slice of the FFN output."""

    # ------------------------------------- FFN side: attention ranks of their own
    keeps_peers_apart: bool = False
    """True for data planes whose peers join and leave one at a time
    (``open_place``, ``join_place``, ``drop_peer``), so that an FFN rank
    serves its other peers on when one is lost, and takes a restarted one
    back at its place."""

    serve_on_after_loss: bool = False
    """Set by the FFN endpoint where it keeps lost peers' places: a peer's
    failed transfer then drops that peer (``take_failed_peers``) instead of
    failing the step for all."""

    def open_place(self, peer: int) -> dict[str, Any]:
        """FFN side: open what a restarted peer at index ``peer`` joins (its
        welcome's data plane, for its ``join``)."""
        raise NotImplementedError(f"{type(self).__name__} takes no peer back")

    def join_place(self, peer: int, data_plane: dict[str, Any]) -> None:
        """FFN side: join the restarted peer at index ``peer``."""
        raise NotImplementedError(f"{type(self).__name__} takes no peer back")

    def drop_peer(self, peer: int) -> None:
        """FFN side: let go of the lost peer at index ``peer``."""
        raise NotImplementedError(f"{type(self).__name__} drops no peer")

    def take_failed_peers(self) -> list[int]:
        """FFN side, with ``serve_on_after_loss``: the peer indexes whose
        transfers failed since the last call (their rows were zeros, their
        answers not sent)."""
        return []

    # ------------------------------------------------------ loss and teardown
    def abort(self) -> None:
        """The peer is gone: let this rank's pending device-side waits on it
        finish. Data planes with ``device_waits`` implement it; the others'
        transfers fail by themselves."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort its data plane")

    def leave(self) -> None:
        """Attention side, the FFN rank lost: let go of what a replacement
        does not join again (by default everything)."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release everything this end holds."""


@runtime_checkable
class InPlaceDataPlane(Protocol):
    """A data plane whose exchange memory the attention rank owns: its
    forward in flight stays blocked where a lost FFN rank left it, its
    flags say which layer each transfer reached (``resume``), and a
    replacement joins the same memory and answers from there. A standby
    maps that memory before it takes over, to capture its graphs in
    advance."""

    def begin_step_on_device(self, step_id: int) -> None:
        """Attention side: mark the start of step ``step_id`` where
        ``exchange_words`` reads it (stream-ordered)."""

    def exchange_words(self) -> tuple[int, list[int], list[int]] | None:
        """Attention side: the step word and the flags by slot each way, or
        None while a forward's start is writing them."""

    def end_lost_rank_waits(self) -> None:
        """Attention side: end what the lost FFN rank left waiting on the
        device, where that outlives it."""

    def standby_offer(
        self, peer_devices: dict[int, dict[str, Any]], layouts: list[TokenLayout] | None
    ) -> dict[str, Any] | None:
        """FFN side, serving: what a standby backing this rank prepares its
        takeover with, from the peers' hellos and the token layouts served in
        graphs; None while those layouts are not known yet."""

    def prepare_in_advance(self, offer: dict[str, Any]) -> list[TokenLayout]:
        """A standby: join what the served rank offered and return the
        layouts to capture (none where it cannot)."""
