# SPDX-License-Identifier: Apache-2.0
"""FFN side: serving attention ranks that are deployments of their own.

Attention ranks of their own (``AFDConfig.attention_rank``, said in the
hello) step without each other: ``SeparatePeers`` reads whichever announce a
step (``read_announcements``) into their ``PeerPlaces``. With
``keep_places`` (the FFN rank's ``failover_timeout_s``) a lost one is
dropped and the others served on; a restarted rank that connects at a lost
one's place has gone through the same handshake (``ControlListener``), waits
in ``take_late_hello``, and is welcomed back by the model thread between two
steps (``admit_returning``).
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.afd_transfer.control.connections import PeerConnections
from vllm.distributed.afd_transfer.control.framing import (
    STEP,
    WELCOME,
    PeerHello,
    peer_closed,
    recv_frame,
    send_frame,
    welcome_body,
)
from vllm.distributed.afd_transfer.control.peers import SERVED, PeerPlaces
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    mismatch_message,
)
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.logger import init_logger

logger = init_logger(__name__)


class SeparatePeers:
    """An FFN rank's attention ranks of their own, once admitted: reads their
    steps, drops the lost ones and takes restarted ones back."""

    def __init__(
        self,
        address: str,
        fingerprint: AFDFingerprint,
        places: PeerPlaces,
        conns: PeerConnections,
        keep_places: bool,
    ) -> None:
        """``address``: the FFN rank's, for its logs; ``fingerprint``: its own,
        which a restarted rank's must match; ``conns``: the FFN rank's
        connections to them, shared with ``ControlServer``."""
        self.address = address
        self.fingerprint = fingerprint
        self.places = places
        self.keep_places = keep_places
        self._conns = conns
        self._returning: queue.Queue[tuple[socket.socket, PeerHello]] = queue.Queue()
        """Restarted attention ranks at a lost one's place, proven and
        checked, waiting for the model thread to welcome them back."""

    def read_announcements(self, wait_s: float) -> list[int]:
        """Model thread: read the next payload of every served place that has
        one within ``wait_s`` into ``places``, and return the places lost
        meanwhile (with ``keep_places``: without, a lost peer is an error, as
        in ``ControlServer.recv_payloads``)."""
        conns = self._conns
        waiting = {conns.open[rank]: rank for rank in self.places.waiting_to_announce()}
        if not waiting:
            time.sleep(wait_s)  # every served place has a step waiting, or none is served
            return []
        readable, _, _ = select.select(list(waiting), [], [], wait_s)
        lost = []
        for conn in readable:
            rank = waiting[conn]
            try:
                payload = ControlPayload.decode(recv_frame(conn, STEP))
            except OSError as e:
                if self.keep_places:
                    self.lose_place(rank, f"disconnected without a shutdown message ({e})")
                    lost.append(rank)
                    continue
                if not conns.ending(rank):
                    raise AFDConnectionError(
                        f"AFD FFN rank on {self.address}: attention rank {rank} disconnected "
                        f"without a shutdown message ({e}); it has exited or crashed"
                    ) from e
                logger.warning("AFD FFN rank on %s: attention rank %d closed without a "
                               "shutdown message after attention ranks %s shut down; taking it "
                               "as the deployment's end", self.address, rank,
                               sorted(conns.finished))  # fmt: skip
                payload = ControlPayload.shutdown_message(self.places.next_step_of(rank))
            self.places.announce(rank, payload)
            if payload.shutdown:
                conns.finished.add(rank)
                if payload.after_failure:
                    conns.failed.add(rank)
                conns.open.pop(rank).close()
                logger.info("AFD FFN rank on %s: attention rank %d shut down%s; serving %s",
                            self.address, rank, " after a failed step" if payload.after_failure
                            else "", self.places.served)  # fmt: skip
        return lost

    def lose_place(self, rank: int, why: str) -> None:
        """Drop a served attention rank of its own (``keep_places``): its
        control connection is closed, so that a rank still alive (a stalled
        one) learns it was dropped, and its place waits for a restart."""
        self.places.lose(rank)
        self._conns.finished.discard(rank)
        conn = self._conns.open.pop(rank, None)
        if conn is not None:
            conn.close()
        logger.warning("AFD FFN rank on %s: attention rank %d %s; dropped, serving attention "
                       "ranks %s on and keeping its place for a restarted one", self.address,
                       rank, why, self.places.served)  # fmt: skip

    def take_late_hello(self, conn: socket.socket, hello: PeerHello) -> str | None:
        """Listener thread: the hello of one of the FFN rank's attention ranks
        that connects once it serves them. With ``keep_places``, a restarted
        attention rank of its own at a place that is not served waits to be
        welcomed back (``admit_returning``) if its fingerprint matches, and
        is told how it differs if not. Returns why anyone else cannot join
        (None once answered here)."""
        rank = hello.attention_rank
        if self.keep_places and hello.separate and self._place_free(rank):
            problems = self.fingerprint.differences(
                hello.fingerprint, "ffn", f"attention rank {rank}"
            )
            if problems:
                logger.error("AFD: restarted %s", mismatch_message(f"attention rank {rank}",
                                                                    problems))  # fmt: skip
                with contextlib.suppress(OSError):
                    send_frame(conn, WELCOME, welcome_body(self.fingerprint, problems, {}))
                conn.close()
                return None
            logger.info(
                "AFD FFN rank on %s: attention rank %d connected again, at its place; "
                "welcoming it back after the step in flight",
                self.address,
                rank,
            )
            self._returning.put((conn, hello))
            return None
        if self.places.state(rank) != SERVED:
            return (
                "this FFN rank does not keep a lost attention rank's place: start it with "
                "failover_timeout_s above 0 to take restarted attention ranks back"
                if not self.keep_places
                else "it is not an attention rank of its own (attention_rank), as the FFN "
                "rank's other peers are"
            )
        return f"attention rank {rank} is served already"

    def admit_returning(
        self,
        open_place: Callable[[int], dict[str, Any]],
        join_place: Callable[[int, dict[str, Any]], None],
        drop_peer: Callable[[int], None],
    ) -> list[int]:
        """Model thread, between steps: welcome back the restarted attention
        ranks waiting (``take_late_hello``). ``open_place(peer)`` opens what
        peer index ``peer`` joins (sent in the welcome), ``join_place(peer,
        it)`` joins it on this side, ``drop_peer(peer)`` lets go of a lost
        one's (a restart that came before its loss was seen). Returns their
        ranks."""
        admitted = []
        while True:
            try:
                conn, hello = self._returning.get_nowait()
            except queue.Empty:
                return admitted
            rank = hello.attention_rank
            peer = self.places.peer_ranks.index(rank)
            if not self._place_free(rank):
                self._refuse_returning(conn, f"attention rank {rank} is served already")
                continue
            if self.places.state(rank) == SERVED:
                self.lose_place(rank, "disconnected without a shutdown message (restarted)")
                drop_peer(peer)
            try:
                data_plane = open_place(peer)
                send_frame(conn, WELCOME, welcome_body(self.fingerprint, [], data_plane))
                conn.settimeout(None)
                join_place(peer, data_plane)
            except (OSError, AFDConnectionError) as e:
                logger.warning("AFD FFN rank on %s: attention rank %d did not join again: %s",
                               self.address, rank, e)  # fmt: skip
                conn.close()
                continue
            self.places.rejoin(rank, hello.resume_step)
            self._conns.open[rank] = conn
            self._conns.failed.discard(rank)
            self._conns.finished.discard(rank)
            logger.info("AFD FFN rank on %s: attention rank %d joined again; serving %s",
                        self.address, rank, self.places.served)  # fmt: skip
            admitted.append(rank)

    def _place_free(self, rank: int) -> bool:
        """Whether a restarted ``rank`` may take its place: it is not served,
        or its served connection has closed (a restart that comes before
        the loss was seen)."""
        if self.places.state(rank) != SERVED:
            return True
        conn = self._conns.open.get(rank)
        return conn is None or peer_closed(conn)

    def _refuse_returning(self, conn: socket.socket, problem: str) -> None:
        logger.error("AFD FFN rank on %s: %s", self.address, problem)
        with contextlib.suppress(OSError):
            send_frame(conn, WELCOME, welcome_body(self.fingerprint, [], {}, refused=problem))
        conn.close()
