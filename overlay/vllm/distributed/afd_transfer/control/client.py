# SPDX-License-Identifier: Apache-2.0
"""The side that connects: ``ControlClient`` (an attention rank) and
``ask_served_rank_as_standby`` (a standby FFN rank).

An attention rank connects to its FFN rank on ``host:port+f``, retrying until
``timeout_s``; the FFN rank challenges first, and this side proves the shared
secret and checks the FFN rank's proof (``auth``), says hello with its
fingerprint, and gets back the FFN rank's verdict plus whatever the data
plane needs to connect (for gloo, the address of a TCP store). The same TCP
connection then carries one ``ControlPayload`` per forward step; the FFN rank
writes on it after the handshake only to stop this rank, with a notice naming
the attention rank it lost (``stop_notice``). A standby FFN rank asks the rank
it backs the same way (the secret, then its fingerprint) before it waits for
the port.

Every wait here is bounded: by ``timeout_s``, or for a standby's question by
``HANDSHAKE_TIMEOUT_S``.
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.afd_transfer import auth
from vllm.distributed.afd_transfer.control.framing import (
    CHALLENGE,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    STANDBY,
    STANDBY_REPLY,
    STEP,
    STOP,
    WELCOME,
    Welcome,
    authenticate,
    configure_socket,
    recv_frame,
    send_frame,
)
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    AFDHandshakeError,
    AFDPeerGoneError,
    mismatch_message,
)
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.resume import PeerPosition
from vllm.logger import init_logger

logger = init_logger(__name__)

HOST_TRY_S = 2.0
"""How long one try at one of several hosts may wait for the connection."""


@dataclass
class StandbyAnswer:
    """A served FFN rank's answer to a standby that can take its place."""

    offer: dict[str, Any] | None
    """What its endpoint offers the standby (``ControlServer``'s ``standby_offer``);
    None while it has nothing to offer yet."""


def ask_served_rank_as_standby(
    host: str, port: int, fingerprint: AFDFingerprint, secret: bytes = b""
) -> StandbyAnswer | None:
    """Standby side, before it waits for the port: ask the FFN rank serving
    on ``host:port``, if any, whether this standby could take its place.
    Returns its answer, or None if no rank answers there (nothing is
    checked: a standby started first takes the place at once). Raises
    ``AFDHandshakeError`` listing the differences, or ``AFDConnectionError``
    if the secrets differ, so that a standby that could never take over says
    so now rather than at a failure."""
    address = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
    except OSError as e:
        logger.info("AFD FFN standby: no FFN rank answers on %s (%s)", address, e)
        return None
    try:
        with sock:
            challenge = recv_frame(sock, CHALLENGE, max_body=auth.CHALLENGE.size)
            authenticate(sock, challenge, secret)
            request = {"fingerprint": fingerprint.to_dict()}
            send_frame(sock, STANDBY, json.dumps(request).encode())
            reply = json.loads(recv_frame(sock, STANDBY_REPLY))
            problems, offer = [str(p) for p in reply["problems"]], reply["offer"]
            if offer is not None and not isinstance(offer, dict):
                raise TypeError(f"the offer must be an object, got {offer!r}")
    except auth.AFDAuthError as e:
        raise AFDConnectionError(
            f"AFD FFN standby: authentication with the FFN rank at {address} failed: {e}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AFDConnectionError) as e:
        logger.warning("AFD FFN standby: could not check this standby against the FFN rank "
                       "on %s (%s); the handshake checks it when it takes over",
                       address, e)  # fmt: skip
        return None
    if problems:
        raise AFDHandshakeError(mismatch_message(f"the FFN rank at {address}", problems))
    return StandbyAnswer(offer)


class ControlClient:
    """Attention side: connects to its FFN rank and sends it payloads."""

    def __init__(
        self,
        host: str,
        port: int,
        attention_rank: int,
        timeout_s: float,
        secret: bytes = b"",
        liveness_s: float = 60.0,
        timeout_name: str = "startup_timeout_s",
        separate: bool = False,
        other_hosts: tuple[str, ...] = (),
    ) -> None:
        """``separate``: this attention rank is a deployment of its own
        (``AFDConfig.attention_rank``), said in the hello. ``other_hosts``:
        where else the FFN rank may answer, on the same port
        (``AFDConfig.failover_hosts``): ``connect`` tries ``host`` and
        these in turn, and keeps the first that answers as ``host``."""
        self.address = f"{host}:{port}"
        self.separate = separate
        self.host, self.port = host, port
        self._hosts = (host, *other_hosts)
        self.attention_rank = attention_rank
        self.timeout_s = timeout_s
        self.timeout_name = timeout_name
        """The AFD config field that ``timeout_s`` comes from (for errors)."""
        self.liveness_s = liveness_s
        """The FFN rank is lost once its host stops answering for about this long."""
        self._secret = secret
        self._sock: socket.socket | None = None
        self._notice: str | None = None
        self._notice_lock = threading.Lock()

    def connect(
        self,
        fingerprint: AFDFingerprint,
        still_waiting: Callable[[], None] = lambda: None,
        device_facts: dict[str, Any] | None = None,
        resume_step: int = 0,
        position: Callable[[], PeerPosition] | None = None,
    ) -> Welcome:
        """Connect (retrying until ``timeout_s``), say hello, read the verdict.

        ``still_waiting`` runs between attempts; it may raise to stop early
        (the launcher uses it to notice a spawned FFN process that died).
        ``device_facts`` travel in the hello for the FFN rank's connector to
        check (``ControlServer.accept_peers``), ``resume_step`` for a
        replacement FFN rank, or, failing over in place, where ``position``
        says this rank stands once a replacement answers (``PeerHello``).
        """
        deadline = time.monotonic() + self.timeout_s
        logged = False
        addresses = " or ".join(f"{h}:{self.port}" for h in self._hosts)
        tries = itertools.cycle(self._hosts)
        while True:
            host = next(tries)
            # With hosts to try in turn, one that drops packets (gone, not
            # refusing) may hold a try only briefly.
            try_s = deadline - time.monotonic()
            if len(self._hosts) > 1:
                try_s = min(try_s, HOST_TRY_S)
            try:
                sock = socket.create_connection((host, self.port), timeout=max(0.1, try_s))
                if sock.getsockname() == sock.getpeername():
                    # Nothing listens yet and the kernel gave this attempt the FFN
                    # rank's port as its own: TCP connected the socket to itself,
                    # and it would keep the FFN rank from binding that port.
                    sock.close()
                    raise ConnectionRefusedError("connected to itself: nothing listens yet")
                # The FFN rank speaks first; it closes connections beyond those
                # it admits at once (a flood), which this retries.
                configure_socket(sock, self.liveness_s)
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    challenge = recv_frame(sock, CHALLENGE, max_body=auth.CHALLENGE.size)
                except (OSError, AFDConnectionError):
                    sock.close()
                    raise
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise AFDConnectionError(
                        f"AFD attention rank {self.attention_rank}: no FFN rank answered at "
                        f"{addresses} within {self.timeout_s:.0f} s ({e}). Start it with "
                        '`vllm afd-ffn MODEL --afd-config \'{"role": "ffn", ...}\'` on that '
                        f"host and port, set spawn_ffn=true, or raise {self.timeout_name}."
                    ) from e
                if not logged:
                    logger.info("AFD: waiting for the FFN rank at %s", addresses)
                    logged = True
                still_waiting()
                if host == self._hosts[-1]:
                    time.sleep(0.2)
        self.host, self.address = host, f"{host}:{self.port}"
        sock.settimeout(self.timeout_s)
        hello = {
            "attention_rank": self.attention_rank,
            "fingerprint": fingerprint.to_dict(),
            "device": device_facts or {},
            "resume_step": resume_step,
            "separate": self.separate,
        }
        if position is not None:
            hello["position"] = position().to_dict()
        try:
            authenticate(sock, challenge, self._secret)
            send_frame(sock, HELLO, json.dumps(hello).encode())
            reply = json.loads(recv_frame(sock, WELCOME))
        except auth.AFDAuthError as e:
            sock.close()
            raise AFDConnectionError(
                f"AFD attention rank {self.attention_rank}: authentication with the FFN rank "
                f"at {self.address} failed: {e}"
            ) from None
        except OSError as e:
            sock.close()
            raise AFDPeerGoneError(
                f"AFD attention rank {self.attention_rank}: the FFN rank at {self.address} "
                f"did not complete the handshake within {self.timeout_s:.0f} s ({e}). Are all "
                "attention ranks of this FFN rank started?"
            ) from e
        if reply["refused"]:
            sock.close()
            raise AFDConnectionError(
                f"AFD attention rank {self.attention_rank}: the FFN rank at {self.address} "
                f"refused the connection: {reply['refused']}"
            )
        welcome = Welcome(
            AFDFingerprint.from_dict(reply["fingerprint"]),
            reply["problems"],
            # Where this rank reached the FFN rank, which opens its data
            # plane's rendezvous on the same host.
            {**reply["data_plane"], "ffn_host": host},
        )
        mine = fingerprint.differences(
            welcome.fingerprint, f"attention rank {self.attention_rank}", "ffn"
        )
        if mine or welcome.problems:
            sock.close()
            raise AFDHandshakeError(
                mismatch_message(f"the FFN rank at {self.address}", mine or welcome.problems)
            )
        self._sock = sock
        return welcome

    @property
    def socket(self) -> socket.socket:
        assert self._sock is not None, "AFD control client is not connected"
        return self._sock

    def send_payload(self, payload: ControlPayload) -> None:
        assert self._sock is not None, "AFD control client is not connected"
        try:
            send_frame(self._sock, STEP, payload.encode())
        except OSError as e:
            raise AFDConnectionError(
                f"AFD attention rank {self.attention_rank}: lost the FFN rank at "
                f"{self.address} ({e}); it has exited or crashed"
            ) from e

    def stop_notice(self, wait_s: float) -> str | None:
        """The FFN rank's reason for stopping, if it sent one within
        ``wait_s``; None if it closed without one, or is still there. Read
        once (the watchdog and a failed transfer may both ask)."""
        with self._notice_lock:
            sock = self._sock
            if self._notice is None and sock is not None:
                try:
                    readable, _, _ = select.select([sock], [], [], wait_s)
                    if readable:
                        self._notice = json.loads(recv_frame(sock, STOP))["reason"]
                except (OSError, ValueError, AFDConnectionError):  # closed without one
                    pass
            return self._notice

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
