# SPDX-License-Identifier: Apache-2.0
"""FFN side of the control plane: ``ControlServer``.

Every FFN rank ``f`` listens on ``host:port+f`` (and only there); each of its
attention peers connects, proves the shared secret (``auth``: the FFN rank
challenges first and parses nothing of a peer before its proof), says hello
with its fingerprint, and gets back the FFN rank's verdict plus whatever the
data plane needs to connect (for gloo, the address of a TCP store). A
connection that fails any of this (wrong secret, garbage, a wrong size, a
silent client held past ``HANDSHAKE_TIMEOUT_S``) is closed and logged; the FFN
rank goes on admitting its peers, each connection in a thread of its own.
The same TCP connection then carries one ``ControlPayload`` per forward step.
A standby FFN rank asks the rank it backs whether it could take its place
(``client.ask_served_rank_as_standby``); an FFN rank answers such questions
from its start on, and once it serves, it refuses attention ranks that come
late.

The FFN rank writes on a peer's connection after the handshake only to stop
it: when one attention rank is lost, the FFN rank sends its other peers a
stop notice naming the lost rank, then exits. One dead attention rank
thus ends the whole deployment, and every rank's error says which one died.

Attention ranks that are deployments of their own (``AFDConfig.attention_rank``,
said in the hello) step without each other: the FFN rank reads whichever
announce a step (``read_announcements``) and keeps their places in
``PeerPlaces``. With ``keep_places`` (the FFN rank's ``failover_timeout_s``)
a lost one is dropped and the others served on; a restarted rank connecting
at a lost one's place goes through the same handshake and is welcomed back
between two steps (``admit_returning``).

Every wait here is bounded by ``timeout_s`` except the FFN rank's wait for the
next step, which lasts as long as the attention side is idle; a peer that dies
closes its socket, which ends that wait with an error at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.afd_transfer import auth
from vllm.distributed.afd_transfer.control.framing import (
    ANSWER,
    BIND_RETRY_S,
    CHALLENGE,
    DENIED,
    END_GRACE_S,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    MAX_PENDING,
    PROOF,
    STANDBY,
    STANDBY_REPLY,
    STEP,
    STOP,
    WELCOME,
    PeerHello,
    bind_fix,
    configure_socket,
    peer_closed,
    recv_frame,
    recv_kind_and_frame,
    send_frame,
)
from vllm.distributed.afd_transfer.control.peers import SERVED, PeerPlaces
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    AFDHandshakeError,
    mismatch_message,
)
from vllm.distributed.afd_transfer.payload import AFD_PROTOCOL_VERSION, ControlPayload
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
        """``standby_offer``: what a standby that matches this rank gets to
        prepare its takeover with, from this rank's endpoint; None while it
        has nothing to offer yet (a standby that wants an offer asks again).
        ``keep_places``: attention ranks of their own that are lost are
        dropped, the others served on, and their places kept for a restart."""
        self.address = f"{host}:{port}"
        self.peer_ranks = peer_ranks
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        """A peer whose host stops answering is lost after about this long."""
        self._secret = secret
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # An attention rank's connection attempt can hold this port for an
        # instant (see ControlClient.connect), so a busy port is retried briefly.
        # A standby retries until the FFN rank that holds it is gone, and on
        # another host until the address (a virtual IP) is moved to this one.
        deadline = time.monotonic() + (float("inf") if standby else min(timeout_s, BIND_RETRY_S))
        retried = {errno.EADDRINUSE, errno.EADDRNOTAVAIL} if standby else {errno.EADDRINUSE}
        if standby:
            logger.info("AFD FFN standby: waiting to take the place of the FFN rank on %s",
                        self.address)  # fmt: skip
        while True:
            try:
                self._listener.bind((host, port))
                break
            except OSError as e:
                if e.errno not in retried or time.monotonic() >= deadline:
                    raise AFDConnectionError(
                        f"AFD FFN rank cannot listen on {self.address}: {e}. {bind_fix(e)}"
                    ) from e
                time.sleep(0.1)
        self._listener.listen(MAX_PENDING)
        self._peers: dict[int, socket.socket] = {}
        """Each connected peer's control connection, by attention rank."""
        self._finished: set[int] = set()
        """Peers that sent their shutdown message: closing is theirs to do."""
        self._failed: set[int] = set()
        """Peers whose shutdown followed a failed step of theirs."""
        self.num_layers = num_layers
        self.resume_step = 0
        """The step the peers announce first (``PeerHello.resume_step``)."""
        self._standby_offer = standby_offer
        self.resume: ResumePlan | None = None
        """After an in-place failover: where this replacement resumes."""
        self.keep_places = keep_places
        self.places: PeerPlaces | None = None
        """Peers that are attention ranks of their own (their hellos say
        so): their places; None for data-parallel peers, which step
        together."""
        self._returning: queue.Queue[tuple[socket.socket, PeerHello]] = queue.Queue()
        """Restarted attention ranks at a lost one's place, proven and
        checked, waiting for the model thread to welcome them back."""

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
            self._admit_next(min(remaining, 0.05), take_hello, slots)

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
            data_plane = {**data_plane, "resume_step": self.resume.step}
        body = self._welcome_body(problems, data_plane)
        for rank in self.peer_ranks:
            conn = hellos[rank][0]
            send_frame(conn, WELCOME, body)
            conn.settimeout(None)  # idle between steps is legitimate
            self._peers[rank] = conn
        if problems:
            self.close()
            raise AFDHandshakeError(mismatch_message("the attention side", problems))
        self._answer_late_connections()
        return data_plane

    def _admit_next(
        self,
        wait_s: float,
        take_hello: Callable[[socket.socket, PeerHello], None],
        slots: threading.BoundedSemaphore,
    ) -> None:
        """Accept the connection that comes within ``wait_s``, if one does,
        and admit it in a thread of its own (``_admit``); one beyond
        ``MAX_PENDING`` at once is closed (a flood: the peers' own attempts
        are retried)."""
        if not select.select([self._listener], [], [], wait_s)[0]:
            return
        conn, peer = self._listener.accept()
        if not slots.acquire(blocking=False):
            conn.close()
            return
        threading.Thread(
            target=self._admit, args=(conn, peer, take_hello, slots), daemon=True
        ).start()

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
            self.places = PeerPlaces(self.peer_ranks, resume)
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

    def _admit(
        self,
        conn: socket.socket,
        peer: tuple,
        take_hello: Callable[[socket.socket, PeerHello], None],
        slots: threading.BoundedSemaphore,
    ) -> None:
        """In a thread of its own: the connection proves the secret within
        ``HANDSHAKE_TIMEOUT_S`` and says hello (an attention rank: passed to
        ``take_hello``) or asks as a standby (answered here), or is closed."""
        try:
            configure_socket(conn, self.liveness_s)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            body, nonce = auth.challenge(AFD_PROTOCOL_VERSION)
            send_frame(conn, CHALLENGE, body)
            answer = recv_frame(conn, ANSWER, max_body=auth.ANSWER.size)
            try:
                proof = auth.check_answer(answer, self._secret, AFD_PROTOCOL_VERSION, nonce)
            except auth.AFDAuthError as e:
                with contextlib.suppress(OSError):
                    send_frame(conn, DENIED, str(e).encode())
                raise
            send_frame(conn, PROOF, proof)
            kind, body = recv_kind_and_frame(conn, HELLO, STANDBY)
            if kind == HELLO:
                take_hello(conn, PeerHello.parse(body))
                return
            send_frame(conn, STANDBY_REPLY, self._standby_reply(body))
            conn.close()
        except (OSError, ValueError, AFDConnectionError, auth.AFDAuthError) as e:
            logger.warning(
                "AFD FFN rank on %s: refused a connection from %s: %s",
                self.address,
                f"{peer[0]}:{peer[1]}",
                e or type(e).__name__,
            )
            conn.close()
        finally:
            slots.release()

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

    def _place_free(self, rank: int) -> bool:
        """Whether a restarted ``rank`` may take its place: it is not served,
        or its served connection has closed (a restart that comes before
        the loss was seen)."""
        if self.places.state(rank) != SERVED:
            return True
        conn = self._peers.get(rank)
        return conn is None or peer_closed(conn)

    def _late_hello(self, conn: socket.socket, hello: PeerHello) -> None:
        """An attention rank that connects once this FFN rank serves its
        peers: with ``keep_places``, a restarted attention rank of its own
        at a place that is not served, whose fingerprint matches, waits to
        be welcomed back (``admit_returning``); anyone else is told why it
        cannot join, at once."""
        rank = hello.attention_rank
        places = self.places
        if (places is not None and self.keep_places and hello.separate
                and rank in self.peer_ranks and self._place_free(rank)):  # fmt: skip
            problems = self.fingerprint.differences(
                hello.fingerprint, "ffn", f"attention rank {rank}"
            )
            if problems:
                logger.error("AFD: restarted %s", mismatch_message(f"attention rank {rank}",
                                                                    problems))  # fmt: skip
                with contextlib.suppress(OSError):
                    send_frame(conn, WELCOME, self._welcome_body(problems, {}))
                conn.close()
                return
            logger.info(
                "AFD FFN rank on %s: attention rank %d connected again, at its place; "
                "welcoming it back after the step in flight",
                self.address,
                rank,
            )
            self._returning.put((conn, hello))
            return
        if places is not None and rank in self.peer_ranks and places.state(rank) != SERVED:
            why = (
                "this FFN rank does not keep a lost attention rank's place: start it with "
                "failover_timeout_s above 0 to take restarted attention ranks back"
                if not self.keep_places
                else "it is not an attention rank of its own (attention_rank), as the FFN "
                "rank's other peers are"
            )
        elif places is not None and rank in self.peer_ranks:
            why = f"attention rank {rank} is served already"
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
            send_frame(conn, WELCOME, self._welcome_body([], {}, refused=problem))
        conn.close()

    def _answer_late_connections(self) -> None:
        """From the handshake on, in a thread: the listener keeps the port
        (a standby binds it once this rank is gone) and answers whoever
        connects: a standby learns whether it can take this rank's place,
        an attention rank why it cannot join."""
        slots = threading.BoundedSemaphore(MAX_PENDING)

        def answer() -> None:
            while True:
                try:
                    self._admit_next(0.2, self._late_hello, slots)
                except (OSError, ValueError):  # the listener closed (close())
                    return

        threading.Thread(target=answer, name="afd-late-connections", daemon=True).start()

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
                send_frame(conn, WELCOME, self._welcome_body([problem], {}))
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
                send_frame(conn, WELCOME, self._welcome_body([], {}, refused=message))
            conn.close()
        self.close()
        raise AFDConnectionError(f"AFD FFN rank on {self.address}: {message}")

    def _welcome_body(
        self, problems: list[str], data_plane: dict[str, Any], refused: str = ""
    ) -> bytes:
        return json.dumps(
            {
                "fingerprint": self.fingerprint.to_dict(),
                "problems": problems,
                "data_plane": data_plane,
                "refused": refused,
            }
        ).encode()

    def recv_payloads(self) -> list[ControlPayload]:
        """The next payload of every peer, in peer order (blocks while idle).

        A peer that closes without a shutdown message is an error, unless
        every other peer has sent theirs (see ``_ending``): then the step is
        the shutdown they announced."""
        payloads: dict[int, ControlPayload] = {}
        lost: list[tuple[int, OSError]] = []
        for rank in self.peer_ranks:
            conn = self._peers[rank]
            if lost and not select.select([conn], [], [], END_GRACE_S)[0]:
                break  # a peer is gone and this one has nothing to say
            try:
                payload = ControlPayload.decode(recv_frame(conn, STEP))
            except OSError as e:
                lost.append((rank, e))
                continue
            if payload.shutdown:
                self._finished.add(rank)
            if payload.after_failure:
                self._failed.add(rank)
                logger.warning(
                    "AFD FFN rank on %s: attention rank %d stops after a failed step "
                    "(its log says why)",
                    self.address,
                    rank,
                )
            payloads[rank] = payload
        if lost:
            rank, error = lost[0]
            if not self._ending(rank):  # so every other peer was read, and shut down
                raise AFDConnectionError(
                    f"AFD FFN rank on {self.address}: attention rank {rank} disconnected "
                    f"without a shutdown message ({error}); it has exited or crashed"
                ) from error
            logger.warning(
                "AFD FFN rank on %s: attention rank %d closed without a shutdown message "
                "after attention ranks %s shut down; taking it as the deployment's end",
                self.address,
                rank,
                sorted(self._finished),
            )
            payloads[rank] = next(iter(payloads.values()))
        return [payloads[rank] for rank in self.peer_ranks]

    def _ending(self, rank: int) -> bool:
        """Whether every peer but ``rank`` (one at least) has shut down after
        finishing its work. A data-parallel rank that then closes without a
        shutdown message is part of the deployment's end, not a crash: it may
        have entered one more step, whose collectives wait for the ranks that
        have left, until vLLM's shutdown kills it (seen at the end of offline
        data-parallel runs). A peer that shut down after a failed step
        (``after_failure``) may have failed because ``rank`` died first."""
        others = [r for r in self.peer_ranks if r != rank]
        return (
            bool(others)
            and all(r in self._finished for r in others)
            and not self._failed.intersection(others)
        )

    def lost_peers(self, wait_s: float) -> list[int]:
        """The peers whose connection closed without a shutdown message
        while another peer still runs (``_ending``), waiting up to ``wait_s``
        for one (a peer's death may reach the data plane first); with
        attention ranks of their own, also the places lost before. Safe to
        call from another thread."""
        deadline = time.monotonic() + wait_s
        while True:
            peers = dict(self._peers)
            places = self.places
            if places is None and len(peers) != len(self.peer_ranks):
                return []  # not connected yet, or closed by this rank
            gone = places.lost if places is not None else []
            lost = gone + [
                rank
                for rank, conn in peers.items()
                if rank not in self._finished and peer_closed(conn) and not self._ending(rank)
                and rank not in gone
            ]  # fmt: skip
            if lost or time.monotonic() >= deadline:
                return sorted(lost)
            time.sleep(0.05)

    # ------------------------------------------- attention ranks of their own
    def read_announcements(self, wait_s: float) -> list[int]:
        """Attention ranks of their own, model thread: read the next payload
        of every served place that has one within ``wait_s`` into
        ``places``, and return the places lost meanwhile (with
        ``keep_places``: without, a lost peer is an error, as in
        ``recv_payloads``)."""
        assert self.places is not None
        waiting = {self._peers[rank]: rank for rank in self.places.waiting_to_announce()}
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
                if not self._ending(rank):
                    raise AFDConnectionError(
                        f"AFD FFN rank on {self.address}: attention rank {rank} disconnected "
                        f"without a shutdown message ({e}); it has exited or crashed"
                    ) from e
                logger.warning("AFD FFN rank on %s: attention rank %d closed without a "
                               "shutdown message after attention ranks %s shut down; taking it "
                               "as the deployment's end", self.address, rank,
                               sorted(self._finished))  # fmt: skip
                payload = ControlPayload.shutdown_message(self.places.next_step_of(rank))
            self.places.announce(rank, payload)
            if payload.shutdown:
                self._finished.add(rank)
                if payload.after_failure:
                    self._failed.add(rank)
                self._peers.pop(rank).close()
                logger.info("AFD FFN rank on %s: attention rank %d shut down%s; serving %s",
                            self.address, rank, " after a failed step" if payload.after_failure
                            else "", self.places.served)  # fmt: skip
        return lost

    def lose_place(self, rank: int, why: str) -> None:
        """Drop a served attention rank of its own (``keep_places``): its
        control connection is closed, so that a rank still alive (a stalled
        one) learns it was dropped, and its place waits for a restart."""
        assert self.places is not None
        self.places.lose(rank)
        self._finished.discard(rank)
        conn = self._peers.pop(rank, None)
        if conn is not None:
            conn.close()
        logger.warning("AFD FFN rank on %s: attention rank %d %s; dropped, serving attention "
                       "ranks %s on and keeping its place for a restarted one", self.address,
                       rank, why, self.places.served)  # fmt: skip

    def admit_returning(
        self,
        open_place: Callable[[int], dict[str, Any]],
        join_place: Callable[[int, dict[str, Any]], None],
        drop_peer: Callable[[int], None],
    ) -> list[int]:
        """Model thread, between steps: welcome back the restarted attention
        ranks waiting (``_late_hello``). ``open_place(peer)`` opens what
        peer index ``peer`` joins (sent in the welcome), ``join_place(peer,
        it)`` joins it on this side, ``drop_peer(peer)`` lets go of a lost
        one's (a restart that came before its loss was seen). Returns their
        ranks."""
        assert self.places is not None
        admitted = []
        while True:
            try:
                conn, hello = self._returning.get_nowait()
            except queue.Empty:
                return admitted
            rank = hello.attention_rank
            peer = self.peer_ranks.index(rank)
            if not self._place_free(rank):
                self._refuse_returning(conn, f"attention rank {rank} is served already")
                continue
            if self.places.state(rank) == SERVED:
                self.lose_place(rank, "disconnected without a shutdown message (restarted)")
                drop_peer(peer)
            try:
                data_plane = open_place(peer)
                send_frame(conn, WELCOME, self._welcome_body([], data_plane))
                conn.settimeout(None)
                join_place(peer, data_plane)
            except (OSError, AFDConnectionError) as e:
                logger.warning("AFD FFN rank on %s: attention rank %d did not join again: %s",
                               self.address, rank, e)  # fmt: skip
                conn.close()
                continue
            self.places.rejoin(rank, hello.resume_step)
            self._peers[rank] = conn
            self._failed.discard(rank)
            self._finished.discard(rank)
            logger.info("AFD FFN rank on %s: attention rank %d joined again; serving %s",
                        self.address, rank, self.places.served)  # fmt: skip
            admitted.append(rank)

    def _refuse_returning(self, conn: socket.socket, problem: str) -> None:
        logger.error("AFD FFN rank on %s: %s", self.address, problem)
        with contextlib.suppress(OSError):
            send_frame(conn, WELCOME, self._welcome_body([], {}, refused=problem))
        conn.close()

    def stop_peers(self, reason: str) -> None:
        """Send every peer still connected a stop notice."""
        body = json.dumps({"reason": reason}).encode()
        for conn in list(self._peers.values()):
            with contextlib.suppress(OSError):
                send_frame(conn, STOP, body)

    def close(self) -> None:
        for conn in list(self._peers.values()):
            conn.close()
        self._peers.clear()
        self._listener.close()
