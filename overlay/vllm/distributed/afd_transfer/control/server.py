# SPDX-License-Identifier: Apache-2.0
"""FFN side of the control plane: ``ControlServer``.

Every FFN rank ``f`` listens on ``host:port+f`` (and only there); each of its
attention peers connects, proves the shared secret and says hello with its
fingerprint (``ControlListener``, which closes and logs a connection that
fails any of this and answers standbys), and gets back the FFN rank's verdict
plus whatever the data plane needs to connect (for gloo, the address of a TCP
store). The same TCP connection then carries one ``ControlPayload`` per
forward step. A standby FFN rank asks the rank it backs whether it could
take its place (``client.ask_served_rank_as_standby``); an FFN rank answers
such questions from its start on, and once it serves, it refuses attention
ranks that come late.

The FFN rank writes on a peer's connection after the handshake only to stop
it: when one attention rank is lost, the FFN rank sends its other peers a
stop notice naming the lost rank, then exits. One dead attention rank
thus ends the whole deployment, and every rank's error says which one died.

Attention ranks that are deployments of their own (``AFDConfig.attention_rank``,
said in the hello) step without each other; ``SeparatePeers`` serves them,
and with ``keep_places`` (the FFN rank's ``failover_timeout_s``) serves the
others on when one is lost and takes restarted ones back at their places.

Every wait here is bounded by ``timeout_s`` except the FFN rank's wait for the
next step, which lasts as long as the attention side is idle; a peer that dies
closes its socket, which ends that wait with an error at once.
"""

from __future__ import annotations

import contextlib
import json
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.afd_transfer.control.connections import PeerConnections
from vllm.distributed.afd_transfer.control.framing import (
    END_GRACE_S,
    MAX_PENDING,
    STEP,
    STOP,
    WELCOME,
    PeerHello,
    peer_closed,
    recv_frame,
    send_frame,
    welcome_body,
)
from vllm.distributed.afd_transfer.control.listener import ControlListener
from vllm.distributed.afd_transfer.control.peers import PeerPlaces
from vllm.distributed.afd_transfer.control.separate import SeparatePeers
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    AFDHandshakeError,
    mismatch_message,
)
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.resume import ResumePlan, resume_plan
from vllm.logger import init_logger

logger = init_logger(__name__)


class ControlServer:
    """FFN side: accepts its attention peers and receives their payloads."""

    def __init__(
        self,
        host: str,
        port: int,
        peer_ranks: list[int],
        fingerprint: AFDFingerprint,
        timeout_s: float,
        secret: bytes = b"",
        liveness_s: float = 60.0,
        standby: bool = False,
        num_layers: int = 1,
        standby_offer: Callable[[], dict[str, Any] | None] = lambda: {},
        keep_places: bool = False,
    ) -> None:
        """``liveness_s``: a peer whose host stops answering is lost after
        about this long. ``standby_offer``: what a standby that matches this
        rank gets to prepare its takeover with, from this rank's endpoint;
        None while it has nothing to offer yet (a standby that wants an offer
        asks again). ``keep_places``: attention ranks of their own that are
        lost are dropped, the others served on, and their places kept for a
        restart."""
        self.peer_ranks = peer_ranks
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self._standby_offer = standby_offer
        self._listener = ControlListener(
            host, port, secret, timeout_s, liveness_s, standby, self._standby_reply
        )
        self.address = self._listener.address
        self._conns = PeerConnections(peer_ranks)
        self.num_layers = num_layers
        self.resume_step = 0
        """The step the peers announce first (``PeerHello.resume_step``)."""
        self.resume: ResumePlan | None = None
        """After an in-place failover: where this replacement resumes."""
        self.keep_places = keep_places
        self._separate: SeparatePeers | None = None
        """Peers that are attention ranks of their own (their hellos say
        so); None for data-parallel peers, which step together."""

    def accept_peers(
        self,
        make_data_plane: Callable[[], dict[str, Any]],
        check_devices: Callable[[dict[int, dict[str, Any]]], list[str]] = lambda _: [],
    ) -> dict[str, Any]:
        """Wait for every peer's hello, check fingerprints, answer each peer.

        ``check_devices`` gets each peer's device facts by rank and returns
        why the data plane cannot join them (sentences; none if it can).
        Returns the data-plane description sent to the peers. Raises
        ``AFDConnectionError`` naming the missing attention ranks when they do
        not all arrive within ``timeout_s`` or when the devices cannot be
        joined, ``AFDHandshakeError`` on a mismatch (after telling the peers,
        so that they fail too).
        """
        logger.info(
            "AFD FFN rank waiting for attention ranks %s on %s (up to %.0f s)",
            self.peer_ranks,
            self.address,
            self.timeout_s,
        )
        deadline = time.monotonic() + self.timeout_s
        hellos: dict[int, tuple[socket.socket, PeerHello]] = {}
        admitted: queue.Queue[tuple[socket.socket, PeerHello]] = queue.Queue()
        slots = threading.BoundedSemaphore(MAX_PENDING)

        def take_hello(conn: socket.socket, hello: PeerHello) -> None:
            admitted.put((conn, hello))

        while len(hellos) < len(self.peer_ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(self.peer_ranks) - set(hellos))
                message = (
                    f"attention rank(s) {missing} did not connect within "
                    f"{self.timeout_s:.0f} s. Start the attention side with the same AFD "
                    "host/port, or raise startup_timeout_s."
                )
                self._refuse(hellos, message)
            with contextlib.suppress(queue.Empty):
                conn, hello = admitted.get_nowait()
                self._take_hello(conn, hello, hellos)
                continue
            self._listener.admit_next(min(remaining, 0.05), take_hello, slots)

        self._settle_separate(hellos)
        self._settle_resume(hellos)
        problems: list[str] = []
        for rank, (_, hello) in sorted(hellos.items()):
            diff = self.fingerprint.differences(hello.fingerprint, "ffn", f"attention rank {rank}")
            problems.extend(diff)
        if not problems:
            refusals = check_devices({rank: hello.device for rank, (_, hello) in hellos.items()})
            if refusals:
                self._refuse(hellos, " ".join(refusals))
        data_plane = {} if problems else make_data_plane()
        if self.resume is not None:
            data_plane = {
                **data_plane,
                "resume_step": self.resume.step,
                "resume_layer": self.resume.layer,
            }
        body = welcome_body(self.fingerprint, problems, data_plane)
        for rank in self.peer_ranks:
            conn = hellos[rank][0]
            send_frame(conn, WELCOME, body)
            conn.settimeout(None)  # idle between steps is legitimate
            self._conns.open[rank] = conn
        if problems:
            self.close()
            raise AFDHandshakeError(mismatch_message("the attention side", problems))
        self._listener.answer_late_connections(self._late_hello)
        return data_plane

    def _settle_separate(self, hellos: dict[int, tuple[socket.socket, PeerHello]]) -> None:
        """Whether the peers are attention ranks of their own (each hello
        says), which all or none must be."""
        separate = {hello.separate for _, hello in hellos.values()}
        if len(separate) > 1:
            alone = sorted(rank for rank, (_, hello) in hellos.items() if hello.separate)
            self._refuse(
                hellos,
                f"attention ranks {alone} are deployments of their own (attention_rank) and "
                "the others data-parallel ranks of one deployment; give all of them "
                "attention_rank, or none",
            )
        if separate == {True}:
            resume = {rank: hello.resume_step for rank, (_, hello) in hellos.items()}
            places = PeerPlaces(self.peer_ranks, resume)
            self._separate = SeparatePeers(
                self.address, self.fingerprint, places, self._conns, self.keep_places
            )
            logger.info(
                "AFD FFN rank on %s: attention ranks %s are deployments of their own; serving "
                "whichever have a step ready%s",
                self.address,
                self.peer_ranks,
                ", and the others on when one is lost" if self.keep_places else "",
            )
        elif self.keep_places:
            logger.info("AFD FFN rank on %s: its attention ranks are the data-parallel ranks of "
                        "one deployment, which ends with any of them (vLLM's data-parallel "
                        "engines do): a lost one stops this rank too", self.address)  # fmt: skip

    def _settle_resume(self, hellos: dict[int, tuple[socket.socket, PeerHello]]) -> None:
        """Where the peers' step count resumes: peers that fail over in place
        report their positions, which give the plan (every peer then
        announces its steps again from the plan's); peers that redo their
        forward must all redo the same one."""
        ordered = [hellos[rank][1] for rank in self.peer_ranks]
        positions = [hello.position for hello in ordered]
        if any(positions):
            if not all(positions):
                self._refuse(hellos, "some attention ranks resume in place and others do not; "
                                     "run the same vLLM-AFD build on all")  # fmt: skip
            if any(p.layer >= self.num_layers for p in positions):
                self._refuse(hellos, f"an attention rank resumes past the last of "
                                     f"{self.num_layers} layers: {positions}")  # fmt: skip
            self.resume = resume_plan(positions, self.num_layers)
            self.resume_step = self.resume.step
            logger.info("AFD FFN rank on %s resumes step %d at layer %d (peers %s: %s)",
                        self.address, self.resume.step, self.resume.layer, self.peer_ranks,
                        positions)  # fmt: skip
            return
        resume = {rank: hellos[rank][1].resume_step for rank in self.peer_ranks}
        if self.places is not None:  # each counts its own steps (_settle_separate)
            return
        if len(set(resume.values())) > 1:
            self._refuse(
                hellos,
                f"the attention ranks resume at different steps {resume}: the lost FFN rank "
                "finished the forward in flight for some of them only, so no single "
                "forward can be run again for all",
            )
        self.resume_step = next(iter(resume.values()))

    def _standby_reply(self, body: bytes) -> bytes:
        """What a standby that backs this FFN rank learns: how its
        fingerprint differs from this rank's (nothing, if it can take over)
        and, if it can, what ``standby_offer`` offers it."""
        try:
            theirs = AFDFingerprint.from_dict(json.loads(body)["fingerprint"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed standby request ({type(e).__name__}: {e})") from e
        problems = self.fingerprint.differences(theirs, "ffn", "standby")
        offer = None
        if problems:
            logger.warning("AFD FFN rank on %s: a standby that cannot take its place asked: %s",
                           self.address, "; ".join(problems))  # fmt: skip
        else:
            offer = self._standby_offer()
            if offer is not None:
                logger.info("AFD FFN rank on %s: a standby backs this rank", self.address)
        return json.dumps({"problems": problems, "offer": offer}).encode()

    def _late_hello(self, conn: socket.socket, hello: PeerHello) -> None:
        """An attention rank that connects once this FFN rank serves its
        peers: a restarted attention rank of its own may take its place back
        (``SeparatePeers.take_late_hello``); anyone else is told why it
        cannot join, at once."""
        rank = hello.attention_rank
        separate = self._separate
        if separate is not None and rank in self.peer_ranks:
            why = separate.take_late_hello(conn, hello)
            if why is None:
                return
        else:
            why = (
                "Give each deployment its own AFD port; an attention rank that restarted "
                "needs its whole deployment restarted, unless the attention ranks are "
                "deployments of their own (attention_rank) and the FFN rank has "
                "failover_timeout_s"
            )
        problem = (
            f"attention rank {rank} connected to the FFN rank on "
            f"{self.address}, which already serves its attention ranks {self.peer_ranks}. " + why
        )
        logger.error("AFD: %s", problem)
        with contextlib.suppress(OSError):
            send_frame(conn, WELCOME, welcome_body(self.fingerprint, [], {}, refused=problem))
        conn.close()

    def _take_hello(
        self,
        conn: socket.socket,
        hello: PeerHello,
        hellos: dict[int, tuple[socket.socket, PeerHello]],
    ) -> None:
        """An authenticated peer's hello: one of this FFN rank's peers, once."""
        rank = hello.attention_rank
        if rank not in self.peer_ranks or rank in hellos:
            problem = (
                f"attention rank {rank} is not a peer of this FFN rank (peers: {self.peer_ranks})"
                if rank not in self.peer_ranks
                else f"attention rank {rank} connected twice"
            )
            with contextlib.suppress(OSError):
                send_frame(conn, WELCOME, welcome_body(self.fingerprint, [problem], {}))
            conn.close()
            logger.error("AFD: %s", problem)
            return
        conn.settimeout(self.timeout_s)
        hellos[rank] = (conn, hello)
        logger.info("AFD: attention rank %d connected", rank)

    def _refuse(self, hellos: dict[int, tuple[socket.socket, PeerHello]], message: str) -> None:
        """Tell the peers that connected why the FFN rank gives up (so they
        fail with the same message), and raise it here."""
        for conn, _ in hellos.values():
            with contextlib.suppress(OSError):
                send_frame(conn, WELCOME, welcome_body(self.fingerprint, [], {}, refused=message))
            conn.close()
        self.close()
        raise AFDConnectionError(f"AFD FFN rank on {self.address}: {message}")

    def recv_payloads(self) -> list[ControlPayload]:
        """The next payload of every peer, in peer order (blocks while idle).

        A peer that closes without a shutdown message is an error, unless
        every other peer has sent theirs (``PeerConnections.ending``): then the step is
        the shutdown they announced."""
        payloads: dict[int, ControlPayload] = {}
        lost: list[tuple[int, OSError]] = []
        for rank in self.peer_ranks:
            conn = self._conns.open[rank]
            if lost and not select.select([conn], [], [], END_GRACE_S)[0]:
                break  # a peer is gone and this one has nothing to say
            try:
                payload = ControlPayload.decode(recv_frame(conn, STEP))
            except OSError as e:
                lost.append((rank, e))
                continue
            if payload.shutdown:
                self._conns.finished.add(rank)
            if payload.after_failure:
                self._conns.failed.add(rank)
                logger.warning(
                    "AFD FFN rank on %s: attention rank %d stops after a failed step "
                    "(its log says why)",
                    self.address,
                    rank,
                )
            payloads[rank] = payload
        if lost:
            rank, error = lost[0]
            if not self._conns.ending(rank):  # so every other peer was read, and shut down
                raise AFDConnectionError(
                    f"AFD FFN rank on {self.address}: attention rank {rank} disconnected "
                    f"without a shutdown message ({error}); it has exited or crashed"
                ) from error
            logger.warning(
                "AFD FFN rank on %s: attention rank %d closed without a shutdown message "
                "after attention ranks %s shut down; taking it as the deployment's end",
                self.address,
                rank,
                sorted(self._conns.finished),
            )
            payloads[rank] = next(iter(payloads.values()))
        return [payloads[rank] for rank in self.peer_ranks]

    def lost_peers(self, wait_s: float) -> list[int]:
        """The peers whose connection closed without a shutdown message
        while another peer still runs (``PeerConnections.ending``), waiting
        up to ``wait_s`` for one (a peer's death may reach the data plane
        first); with attention ranks of their own, also the places lost
        before. Safe to call from another thread."""
        deadline = time.monotonic() + wait_s
        conns = self._conns
        while True:
            peers = dict(conns.open)
            places = self.places
            if places is None and len(peers) != len(self.peer_ranks):
                return []  # not connected yet, or closed by this rank
            gone = places.lost if places is not None else []
            lost = gone + [
                rank
                for rank, conn in peers.items()
                if rank not in conns.finished and peer_closed(conn) and not conns.ending(rank)
                and rank not in gone
            ]  # fmt: skip
            if lost or time.monotonic() >= deadline:
                return sorted(lost)
            time.sleep(0.05)

    # ------------------------------------------- attention ranks of their own
    @property
    def places(self) -> PeerPlaces | None:
        """The places of peers that are attention ranks of their own; None
        for data-parallel peers."""
        return self._separate.places if self._separate is not None else None

    def read_announcements(self, wait_s: float) -> list[int]:
        """See ``SeparatePeers.read_announcements``."""
        assert self._separate is not None
        return self._separate.read_announcements(wait_s)

    def lose_place(self, rank: int, why: str) -> None:
        """See ``SeparatePeers.lose_place``."""
        assert self._separate is not None
        self._separate.lose_place(rank, why)

    def admit_returning(
        self,
        open_place: Callable[[int], dict[str, Any]],
        join_place: Callable[[int, dict[str, Any]], None],
        drop_peer: Callable[[int], None],
    ) -> list[int]:
        """See ``SeparatePeers.admit_returning``."""
        assert self._separate is not None
        return self._separate.admit_returning(open_place, join_place, drop_peer)

    # ------------------------------------------------------------------ end
    def stop_peers(self, reason: str) -> None:
        """Send every peer still connected a stop notice."""
        body = json.dumps({"reason": reason}).encode()
        for conn in list(self._conns.open.values()):
            with contextlib.suppress(OSError):
                send_frame(conn, STOP, body)

    def close(self) -> None:
        self._conns.close()
        self._listener.close()
