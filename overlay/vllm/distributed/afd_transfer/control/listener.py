# SPDX-License-Identifier: Apache-2.0
"""FFN side: the listening socket and the admission of whoever connects.

``ControlListener`` binds the FFN rank's port (a standby waits for it) and
admits each connection in a thread of its own: the connection proves the
shared secret (``auth``: the FFN rank challenges first and parses nothing of
a peer before its proof), then says hello, which goes to the caller, or asks
as a standby, which is answered here. A connection that fails any of this is
closed and logged; the others go on. What a hello leads to is the caller's
(``ControlServer``): this module knows nothing of peers or steps.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
import time
from collections.abc import Callable

from vllm.distributed.afd_transfer import auth
from vllm.distributed.afd_transfer.control.framing import (
    ANSWER,
    BIND_RETRY_S,
    CHALLENGE,
    DENIED,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    MAX_PENDING,
    PROOF,
    STANDBY,
    STANDBY_REPLY,
    PeerHello,
    bind_fix,
    configure_socket,
    recv_frame,
    recv_kind_and_frame,
    send_frame,
)
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import AFD_PROTOCOL_VERSION
from vllm.logger import init_logger

logger = init_logger(__name__)

TakeHello = Callable[[socket.socket, PeerHello], None]
"""Gets an authenticated attention rank's connection and its hello."""


class ControlListener:
    """An FFN rank's port: binds it, then admits the connections to it."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        timeout_s: float,
        liveness_s: float,
        standby: bool,
        answer_standby: Callable[[bytes], bytes],
    ) -> None:
        """``answer_standby``: the reply to a standby's request body.
        ``liveness_s``: see ``configure_socket``."""
        self.address = f"{host}:{port}"
        self._secret = secret
        self._liveness_s = liveness_s
        self._answer_standby = answer_standby
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
                self.sock.bind((host, port))
                break
            except OSError as e:
                if e.errno not in retried or time.monotonic() >= deadline:
                    raise AFDConnectionError(
                        f"AFD FFN rank cannot listen on {self.address}: {e}. {bind_fix(e)}"
                    ) from e
                time.sleep(0.1)
        self.sock.listen(MAX_PENDING)

    def admit_next(
        self, wait_s: float, take_hello: TakeHello, slots: threading.BoundedSemaphore
    ) -> None:
        """Accept the connection that comes within ``wait_s``, if one does,
        and admit it in a thread of its own (``_admit``); one beyond
        ``slots`` (``MAX_PENDING`` at once) is closed (a flood: the peers'
        own attempts are retried)."""
        if not select.select([self.sock], [], [], wait_s)[0]:
            return
        conn, peer = self.sock.accept()
        if not slots.acquire(blocking=False):
            conn.close()
            return
        threading.Thread(
            target=self._admit, args=(conn, peer, take_hello, slots), daemon=True
        ).start()

    def _admit(
        self,
        conn: socket.socket,
        peer: tuple,
        take_hello: TakeHello,
        slots: threading.BoundedSemaphore,
    ) -> None:
        """In a thread of its own: the connection proves the secret within
        ``HANDSHAKE_TIMEOUT_S`` and says hello (an attention rank: passed to
        ``take_hello``) or asks as a standby (answered here), or is closed."""
        try:
            configure_socket(conn, self._liveness_s)
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
            send_frame(conn, STANDBY_REPLY, self._answer_standby(body))
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

    def answer_late_connections(self, take_hello: TakeHello) -> None:
        """From the handshake on, in a thread: the listener keeps the port
        (a standby binds it once this rank is gone) and admits whoever
        connects: a standby is answered, an attention rank's hello goes to
        ``take_hello``. Ends with ``close``."""
        slots = threading.BoundedSemaphore(MAX_PENDING)

        def answer() -> None:
            while True:
                try:
                    self.admit_next(0.2, take_hello, slots)
                except (OSError, ValueError):  # the listener closed (close())
                    return

        threading.Thread(target=answer, name="afd-late-connections", daemon=True).start()

    def close(self) -> None:
        self.sock.close()
