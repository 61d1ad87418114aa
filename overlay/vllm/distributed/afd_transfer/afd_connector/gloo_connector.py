# SPDX-License-Identifier: Apache-2.0
"""The ``gloo`` connector: CPU tensors over torch.distributed gloo point-to-point.

Why gloo rather than shared memory: it works between hosts as well as on
one, its transfers are bounded (``transfer_timeout_s`` in real steps), and a peer
that dies closes its TCP connection, which fails the pending transfer at once
("Connection closed by peer") instead of leaving a reader spinning on a
shared-memory flag. On one host the extra copy through loopback TCP costs
microseconds per layer at the sizes a CPU model runs.

The FFN rank forms one group of two with each peer (FFN rank = group rank 0,
the peer = 1), through its store (``StoreGroupDataPlane``), under the
name ``peer<index>`` in the namespace that the welcome names; the gloo
device is bound to each rank's own address. Groups of two keep the peers
apart: a lost peer takes only its own group with it, the FFN rank serves
the others on, and a restarted peer forms a new group at its place, in a
namespace of its own (``open_place``, ``join_place``).

Failing over in place (``failover.HostInPlaceFailover``), an attention rank
keeps copies of the rows it sent for its last two layers: a transfer that
finds the FFN rank lost waits for a replacement, which resumes at this
layer or, where another peer stands a layer behind, at the one before;
those rows go to it again (``send_kept_again``). A replacement's first
step answers no peer that has that layer's output already.
"""

from __future__ import annotations

import collections
import secrets
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store
from vllm.distributed.afd_transfer.afd_connector.rendezvous_store import StoreGroupDataPlane
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import MAX_STAGES
from vllm.distributed.afd_transfer.resume import PeerPosition
from vllm.logger import init_logger

logger = init_logger(__name__)

WHILE_THE_PEER_LIVES = timedelta(days=365)
"""The bound of a transfer before serving: none that a start-up reaches."""


def _tag(layer: int, stage: int) -> int:
    return layer * MAX_STAGES + stage  # one tag per stage of each layer


class GlooDataPlane(StoreGroupDataPlane):
    keeps_peers_apart = True

    def __init__(self, spec, exchange) -> None:
        super().__init__(spec, exchange)
        self._groups: dict[int, ProcessGroupGloo] = {}
        """FFN side: each peer's group, by peer index; attention side: its
        own, under index 0."""
        self._failed: list[int] = []
        self._kept: collections.deque[tuple[PeerPosition, int, torch.Tensor]] = collections.deque(
            maxlen=2
        )
        """Attention side, failing over in place: the rows sent last, with
        their step, layer and stage."""

    def _new_group(
        self, store: Store, peer: int, assembly_s: float | None = None
    ) -> ProcessGroupGloo:
        options = ProcessGroupGloo._Options()
        # gloo listens for its pairs on this address: each rank's own
        options._devices = [ProcessGroupGloo.create_device(hostname=self.exchange.local_address)]
        # The group's timeout bounds its assembly (startup_timeout_s unless
        # given); each transfer then waits for its own bound (_bound), which
        # overrides the group's.
        assembly_s = assembly_s or self.spec.afd_config.startup_timeout_s
        options._timeout = timedelta(seconds=assembly_s)
        rank = 0 if self.spec.role == "ffn" else 1
        with self._guard("joining the gloo group", peer):
            return ProcessGroupGloo(PrefixStore(f"peer{peer}", store), rank, 2, options)

    def _join_group(self, store: Store) -> None:
        if self.spec.role == "attention":
            self._groups = {0: self._new_group(store, self.spec.peer_index)}
            return
        # The peers form theirs at once after the welcome; one after another here.
        self._groups = {peer: self._new_group(store, peer)
                        for peer in range(len(self.spec.peer_ranks))}  # fmt: skip

    # ------------------------------------------------ peers one at a time (FFN)
    def open_place(self, peer: int) -> dict[str, Any]:
        return {
            "store_port": self._store_port,
            "store_prefix": f"afd/ffn{self.spec.ffn_rank}/{secrets.token_hex(16)}",
        }

    def join_place(self, peer: int, data_plane: dict[str, Any]) -> None:
        assert self._store is not None
        store = PrefixStore(data_plane["store_prefix"], self._store)
        # The other peers wait meanwhile: the restarted one joins right after
        # its welcome, or within timeout_s is taken for lost again.
        self._groups[peer] = self._new_group(store, peer, self.spec.afd_config.timeout_s)

    def drop_peer(self, peer: int) -> None:
        self._groups.pop(peer, None)
        self._failed = [p for p in self._failed if p != peer]

    def take_failed_peers(self) -> list[int]:
        failed, self._failed = sorted(set(self._failed)), []
        return failed

    # ------------------------------------------------------------- transfers
    def _bound(self) -> timedelta:
        # A gloo wait that times out closes its pair, so an unbounded wait
        # cannot be made of short ones; the peer's death fails it instead.
        if self.exchange.transfer_timeout_s is None:
            return WHILE_THE_PEER_LIVES
        return timedelta(seconds=self.exchange.transfer_timeout_s)

    @contextmanager
    def _guard(self, what: str, peer: int | None = None):
        try:
            yield
        except RuntimeError as e:
            gloo = str(e).splitlines()[0]
            spec, timeout_s = self.spec, self.exchange.transfer_timeout_s
            if spec.role == "attention":
                wait_s = min(5.0, spec.afd_config.timeout_s)
                lost = self.exchange.describe_lost_ffn_rank(wait_s)
                raise AFDConnectionError(f"{lost}, while {what} (gloo: {gloo})") from e
            stalled = "" if timeout_s is None else f" or stalled for over {timeout_s:.0f} s"
            ranks = list(spec.peer_ranks) if peer is None else [spec.peer_ranks[peer]]
            raise AFDConnectionError(
                f"AFD ffn rank {spec.rank}: lost attention ranks {ranks} while "
                f"{what} "
                f"(gloo: {gloo}). A peer process has exited, crashed{stalled}; see its log."
            ) from e

    def _ffn_transfers(self, post: dict[int, Any], what: str) -> list[int]:
        """FFN side: start each peer's transfer (``post``: peer index to a
        function that starts it) and wait for them. A failed one fails the
        step, or, with ``serve_on_after_loss``, drops that peer for the
        rest of it (returned, and kept for ``take_failed_peers``)."""
        failed = []

        def lost(peer: int, error: AFDConnectionError) -> None:
            if not self.serve_on_after_loss:
                raise error
            logger.warning("%s; serving the other peers on", error)
            failed.append(peer)
            self._failed.append(peer)

        works = []
        for peer, start in post.items():
            try:
                with self._guard(what, peer):
                    works.append((peer, start()))
            except AFDConnectionError as e:
                lost(peer, e)
        for peer, work in works:
            try:
                with self._guard(what, peer):
                    work.wait(self._bound())
            except AFDConnectionError as e:
                lost(peer, e)
        return failed

    # attention side
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        if hidden_states.shape[0] == 0:
            return
        rows = hidden_states.contiguous()
        if self.exchange.resume_after_loss is not None:
            position = PeerPosition(self.exchange.step_id, layer)
            self._kept.append((position, stage, rows.clone()))
        try:
            self._send(rows, layer, stage)
        except AFDConnectionError:
            if self.exchange.resume_after_loss is None:
                raise
            self._resume(layer)  # sends this layer's rows again

    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        if out.shape[0] == 0:
            return
        while True:
            try:
                with self._guard(f"waiting for the FFN output of layer {layer} stage {stage}"):
                    self._groups[0].recv([out], 0, _tag(layer, stage)).wait(self._bound())
                return
            except AFDConnectionError:
                if self.exchange.resume_after_loss is None:
                    raise
                self._resume(layer)

    def _send(self, rows: torch.Tensor, layer: int, stage: int) -> None:
        with self._guard(f"sending layer {layer} stage {stage}"):
            self._groups[0].send([rows], 0, _tag(layer, stage)).wait(self._bound())

    def _resume(self, layer: int) -> None:
        """A transfer of ``layer`` found the FFN rank lost: wait for a
        replacement, then send it the rows it resumes from."""
        assert self.exchange.resume_after_loss is not None
        start = self.exchange.resume_after_loss(self.exchange.step_id, layer)
        self.send_kept_again(start)

    def send_kept_again(self, start: PeerPosition) -> None:
        """Attention side, after a replacement joined: send the kept rows of
        every layer from ``start``, where it resumes, on."""
        for position, stage, rows in list(self._kept):
            if (position.step, position.layer) >= (start.step, start.layer):
                self._send(rows, position.layer, stage)

    # FFN side
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        buffers = [
            torch.empty((n, self.spec.input_width), dtype=self.spec.dtype) for n in token_counts
        ]
        post = {}
        for peer, buf in enumerate(buffers):
            if not buf.shape[0]:
                continue
            if peer in self._failed:  # lost earlier in this step
                buf.zero_()
                continue
            group = self._groups[peer]
            post[peer] = lambda g=group, b=buf: g.recv([b], 1, _tag(layer, stage))
        for peer in self._ffn_transfers(post, f"receiving layer {layer} stage {stage}"):
            buffers[peer].zero_()  # a lost peer's rows: whatever arrived, not served
        return buffers

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        tag, resume = _tag(layer, stage), self.exchange.resuming_at(layer)
        post = {
            peer: lambda g=self._groups[peer], o=out: g.send([o.contiguous()], 1, tag)
            for peer, out in enumerate(outputs)
            if out.shape[0]
            and peer not in self._failed
            and not (resume is not None and resume.answered(peer))
        }
        self._ffn_transfers(post, f"sending the FFN output of layer {layer} stage {stage}")
        if resume is not None:
            self.exchange.resuming = None  # the resumed layer is answered

    def close(self) -> None:
        self._groups = {}
        super().close()
