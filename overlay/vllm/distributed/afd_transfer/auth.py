# SPDX-License-Identifier: Apache-2.0
"""Mutual proof of a shared secret between an FFN rank and a peer, first on
every control connection, before anything else the peer sends is parsed.

The FFN rank opens with a challenge (magic, protocol version, a random
nonce); the peer answers with its own nonce and an HMAC-SHA256 over both
nonces; the FFN rank checks it and proves itself the same way over the nonces
in the other order, or refuses the connection with a reason. Every frame of
the exchange has a fixed size. Without a configured secret both sides use
the empty one: the exchange still runs (one wire format), and a secret on one
side only fails like a wrong secret. A peer that passed it learns the data
plane's rendezvous (``Welcome.data_plane``), which nobody else does.

The secret comes from ``AFDConfig.secret_file`` or the ``VLLM_AFD_SECRET``
environment variable (containers).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import struct
from pathlib import Path

SECRET_VARIABLE = "VLLM_AFD_SECRET"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MAGIC = b"AFD"
CHALLENGE = struct.Struct(f"<3sH{NONCE_BYTES}s")  # magic, protocol version, FFN nonce
ANSWER = struct.Struct(f"<H{NONCE_BYTES}s{MAC_BYTES}s")  # version, peer nonce, peer's MAC


class AFDAuthError(Exception):
    """A peer did not prove the shared secret, or spoke another protocol."""


def load_secret(secret_file: str | None) -> bytes:
    """The deployment's shared secret: the file's contents (surrounding white
    space stripped), else ``$VLLM_AFD_SECRET``, else empty (no secret)."""
    if secret_file:
        path = Path(secret_file)
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ValueError(f"AFD secret_file {secret_file!r} cannot be read: {e}") from e
        if not secret:
            raise ValueError(f"AFD secret_file {secret_file!r} is empty; put the secret in it")
        return secret
    return os.environ.get(SECRET_VARIABLE, "").strip().encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _mac(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + first + second, hashlib.sha256).digest()


def challenge(version: int) -> tuple[bytes, bytes]:
    """FFN side: the challenge frame's body, and its nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return CHALLENGE.pack(MAGIC, version, nonce), nonce


def answer(body: bytes, secret: bytes, version: int) -> tuple[bytes, bytes, bytes]:
    """Peer side: the answer to a challenge, the peer's nonce, and the FFN
    rank's nonce (to check its proof)."""
    if len(body) != CHALLENGE.size:
        raise AFDAuthError("the FFN rank's challenge has the wrong size")
    magic, their_version, ffn_nonce = CHALLENGE.unpack(body)
    if magic != MAGIC:
        raise AFDAuthError("the listener there is not an AFD FFN rank")
    if their_version != version:
        raise AFDAuthError(
            f"the FFN rank speaks AFD protocol {their_version}, this rank {version}: "
            "run the same vLLM-AFD build on every rank"
        )
    nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(secret, b"attention", ffn_nonce, nonce)
    return ANSWER.pack(version, nonce, mac), nonce, ffn_nonce


def check_answer(body: bytes, secret: bytes, version: int, ffn_nonce: bytes) -> bytes:
    """FFN side: raises unless ``body`` proves the secret; returns the FFN
    rank's proof for the peer."""
    if len(body) != ANSWER.size:
        raise AFDAuthError(f"an answer of {len(body)} bytes, not {ANSWER.size}")
    their_version, nonce, mac = ANSWER.unpack(body)
    if their_version != version:
        raise AFDAuthError(
            f"the peer speaks AFD protocol {their_version}, this FFN rank {version}: "
            "run the same vLLM-AFD build on every rank"
        )
    if not hmac.compare_digest(mac, _mac(secret, b"attention", ffn_nonce, nonce)):
        raise AFDAuthError(
            "the peer did not prove the shared secret: give every rank the same "
            f"secret_file or {SECRET_VARIABLE}"
        )
    return _mac(secret, b"ffn", nonce, ffn_nonce)


def check_proof(proof: bytes, secret: bytes, nonce: bytes, ffn_nonce: bytes) -> None:
    """Peer side: raises unless the FFN rank proved the secret too."""
    if not hmac.compare_digest(proof, _mac(secret, b"ffn", nonce, ffn_nonce)):
        raise AFDAuthError(
            "the FFN rank did not prove the shared secret: give every rank the same "
            f"secret_file or {SECRET_VARIABLE}"
        )
