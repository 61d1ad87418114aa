# SPDX-License-Identifier: Apache-2.0
"""The wire format of the control plane, and what both of its sides share.

A frame is a message kind and a body length (``_FRAME``), then the body; a
receiver names the kinds it expects and the largest body it takes, and
refuses anything else before it reads a body byte. A connection goes: the FFN
rank's ``CHALLENGE``, the peer's ``ANSWER`` and the FFN rank's ``PROOF`` (or
``DENIED``: ``auth``; the FFN rank parses nothing of a peer before its
proof), then the peer's ``HELLO`` (``PeerHello``) and the FFN rank's
``WELCOME`` (``Welcome``), or a standby's ``STANDBY`` question and its
``STANDBY_REPLY``. Then one ``STEP`` (a ``ControlPayload``) per forward step,
and from the FFN rank at most a ``STOP`` notice.

Every control connection carries TCP keepalive and a user timeout derived
from ``liveness_s`` (``configure_socket``), so a peer host that vanishes
fails the connection within about that long.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.afd_transfer import auth
from vllm.distributed.afd_transfer.handshake import AFDConnectionError, AFDFingerprint
from vllm.distributed.afd_transfer.payload import AFD_PROTOCOL_VERSION
from vllm.distributed.afd_transfer.resume import PeerPosition

_FRAME = struct.Struct("<BI")  # message kind, body length
# The message kinds (see the module docstring for their order).
HELLO, WELCOME, STEP, STOP = 1, 2, 3, 4
CHALLENGE, ANSWER, PROOF, DENIED = 5, 6, 7, 8
STANDBY, STANDBY_REPLY = 9, 10
_MAX_BODY = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
"""How long the FFN rank gives one connection to prove the secret and say
hello; a silent or slow one is closed, not waited for."""
MAX_PENDING = 256
"""Connections the FFN rank admits at once; more are closed at once."""
BIND_RETRY_S = 3.0
"""How long the FFN rank retries a busy port before calling it taken."""
END_GRACE_S = 5.0
"""Once a peer is gone, how long the FFN rank waits for each remaining
peer's payload (its shutdown message, if the deployment is ending)."""


def send_frame(sock: socket.socket, kind: int, body: bytes) -> None:
    """Send one frame of ``kind`` with ``body``."""
    sock.sendall(_FRAME.pack(kind, len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; the peer closing before them is an error."""
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionResetError("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, *expected_kinds: int, max_body: int = _MAX_BODY) -> bytes:
    """The body of the next frame (see ``recv_kind_and_frame``)."""
    return recv_kind_and_frame(sock, *expected_kinds, max_body=max_body)[1]


def recv_kind_and_frame(
    sock: socket.socket, *expected_kinds: int, max_body: int = _MAX_BODY
) -> tuple[int, bytes]:
    """The next frame, of one of ``expected_kinds`` and at most ``max_body``
    bytes (checked before any body byte is read)."""
    kind, length = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if kind not in expected_kinds or length > max_body:
        raise AFDConnectionError(
            f"unexpected AFD control frame (kind {kind}, {length} bytes): the peer is "
            "not a vLLM-AFD rank of this version"
        )
    return kind, _recv_exact(sock, length)


KEEPALIVE_PROBES = 3


def configure_socket(sock: socket.socket, liveness_s: float) -> None:
    """Low latency, and a peer that vanishes without closing (its host down,
    or the network between cut) is noticed within about ``liveness_s``: such
    a peer sends no FIN or RST, so the kernel probes the idle connection, and
    gives up on unacknowledged data, then fails the connection. A peer
    process that is alive but busy (compiling, or stopped) keeps its
    kernel's answers coming, so it is never taken for lost this way."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(liveness_s / 3))
    interval = max(1, int(liveness_s / (2 * KEEPALIVE_PROBES)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    unanswered_ms = 1000 * (idle + KEEPALIVE_PROBES * interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, unanswered_ms)


@dataclass
class PeerHello:
    """What an attention rank says once it has proven the secret."""

    attention_rank: int
    fingerprint: AFDFingerprint
    device: dict[str, Any] = field(default_factory=dict)
    """What the peer's connector says about its device (``device_facts``)."""
    resume_step: int = 0
    """The step the peer announces next: 0 at start-up; after failover, the
    step it runs again (a replacement FFN rank continues the count there)."""
    position: PeerPosition | None = None
    """After an in-place failover (ipc): where the peer's exchange stands;
    the replacement resumes there (``resume.resume_plan``)."""
    separate: bool = False
    """The peer is an attention rank of its own (``AFDConfig.attention_rank``),
    stepping without the FFN rank's other peers."""

    @classmethod
    def parse(cls, body: bytes) -> PeerHello:
        try:
            hello = json.loads(body)
            rank, device = hello["attention_rank"], hello.get("device", {})
            resume_step = hello.get("resume_step", 0)  # another version: its fingerprint says
            if not isinstance(rank, int) or not isinstance(device, dict):
                raise TypeError("attention_rank must be a number and device an object")
            if not isinstance(resume_step, int) or resume_step < 0:
                raise TypeError("resume_step must be a step number")
            position = hello.get("position")
            if position is not None:
                position = PeerPosition.from_dict(position)
            separate = hello.get("separate", False)
            if not isinstance(separate, bool):
                raise TypeError("separate must be true or false")
            fingerprint = AFDFingerprint.from_dict(hello["fingerprint"])
            return cls(rank, fingerprint, device, resume_step, position, separate)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed hello ({type(e).__name__}: {e})") from e


@dataclass
class Welcome:
    """The FFN rank's verdict on a hello, and what the data plane needs."""

    fingerprint: AFDFingerprint
    problems: list[str]
    data_plane: dict[str, Any] = field(default_factory=dict)


def welcome_body(
    fingerprint: AFDFingerprint,
    problems: list[str],
    data_plane: dict[str, Any],
    refused: str = "",
) -> bytes:
    """The body of the FFN rank's ``WELCOME``: its fingerprint, what differs
    in the peer's, the data plane to join, or why it refuses the peer."""
    return json.dumps(
        {
            "fingerprint": fingerprint.to_dict(),
            "problems": problems,
            "data_plane": data_plane,
            "refused": refused,
        }
    ).encode()


def bind_fix(error: OSError) -> str:
    """What to do when the FFN rank's listener cannot bind."""
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            "The AFD config's host is not an address of this machine: set it to one (the "
            'address the attention ranks reach), or start a standby ("standby": true), '
            "which waits for the address to be moved here."
        )
    return "Is another FFN rank running there? Pick a free port in the AFD config."


def peer_closed(conn: socket.socket) -> bool:
    """Whether the peer closed ``conn``. Payloads it sent before closing are
    read first: until then the connection counts as open."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, ValueError):  # nothing to read; closed on this side
        return False
    except OSError:
        return True


def authenticate(sock: socket.socket, challenge: bytes, secret: bytes) -> None:
    """Answer the FFN rank's challenge and check its proof (``auth``)."""
    answer, nonce, ffn_nonce = auth.answer(challenge, secret, AFD_PROTOCOL_VERSION)
    send_frame(sock, ANSWER, answer)
    kind, reply = recv_kind_and_frame(sock, PROOF, DENIED)
    if kind == DENIED:
        raise auth.AFDAuthError(f"it refused this rank: {reply.decode(errors='replace')}")
    auth.check_proof(reply, secret, nonce, ffn_nonce)
