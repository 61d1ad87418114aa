"""The FFN rank's listening socket under hostile input, and the shared secret.

A real ControlServer (FFN side, in a thread) with a secret, and for each
case a raw socket that misbehaves; then the FFN rank's real peer (a
ControlClient with the secret) must still be admitted: a rogue or broken
client is refused alone. The secret's configuration is checked through
AFDConfig.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
from test_afd_control import FINGERPRINT, serve_in_thread
from vllm.config import AFDConfig
from vllm.distributed.afd_transfer import auth
from vllm.distributed.afd_transfer.control import listener as control_listener
from vllm.distributed.afd_transfer.control.client import (
    ControlClient,
    ask_served_rank_as_standby,
)
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import AFD_PROTOCOL_VERSION

from vllm_afd_dev.harness.generate import free_port

SECRET = b"the deployment's secret"
ONE_PEER = FINGERPRINT.__class__(**{**FINGERPRINT.to_dict(), "num_attention_ranks": 1})


@pytest.fixture
def ffn_rank(monkeypatch):
    """An FFN rank with one peer (attention rank 0), admitting connections
    for 30 s, each given 1 s to prove the secret and say hello."""
    monkeypatch.setattr(control_listener, "HANDSHAKE_TIMEOUT_S", 1.0)
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], ONE_PEER, timeout_s=30, secret=SECRET)
    thread, result = serve_in_thread(server)
    yield port, thread, result
    thread.join(timeout=35)
    server.close()


def the_peer_is_admitted(port, thread, result, secret=SECRET) -> None:
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10, secret=secret)
    start = time.monotonic()
    client.connect(ONE_PEER)
    thread.join(timeout=10)
    assert "error" not in result and result["data_plane"] == {"store_port": 1}
    assert time.monotonic() - start < 5
    client.close()


def raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def frame(kind: int, body: bytes) -> bytes:
    return struct.pack("<BI", kind, len(body)) + body


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = struct.unpack("<BI", sock.recv(5, socket.MSG_WAITALL))
    return kind, sock.recv(length, socket.MSG_WAITALL)


def closed_by_the_ffn_rank(sock: socket.socket, within_s: float = 5) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def proven_answer(sock: socket.socket, version: int = AFD_PROTOCOL_VERSION) -> bytes:
    """A correct answer to the FFN rank's challenge (as protocol ``version``)."""
    kind, challenge = read_frame(sock)
    assert kind == 5 and challenge[:3] == b"AFD"
    answer, _, _ = auth.answer(challenge, SECRET, AFD_PROTOCOL_VERSION)
    if version != AFD_PROTOCOL_VERSION:
        answer = struct.pack("<H", version) + answer[2:]
    return frame(6, answer)


def test_garbage_bytes_are_refused(ffn_rank):
    sock = raw(ffn_rank[0])
    sock.sendall(bytes(range(256)) * 8)
    assert closed_by_the_ffn_rank(sock)
    the_peer_is_admitted(*ffn_rank)


def test_a_truncated_hello_is_refused(ffn_rank):
    sock = raw(ffn_rank[0])
    sock.sendall(proven_answer(sock))
    assert read_frame(sock)[0] == 7  # the FFN rank's proof
    sock.sendall(struct.pack("<BI", 1, 500) + b'{"attention_rank": 0, "finger')
    assert closed_by_the_ffn_rank(sock)
    the_peer_is_admitted(*ffn_rank)


def test_a_malformed_hello_is_refused(ffn_rank):
    sock = raw(ffn_rank[0])
    sock.sendall(proven_answer(sock))
    read_frame(sock)
    sock.sendall(frame(1, b'{"attention_rank": "zero", "fingerprint": 7}'))
    assert closed_by_the_ffn_rank(sock)
    the_peer_is_admitted(*ffn_rank)


def test_an_oversize_length_prefix_is_refused_before_reading_it(ffn_rank):
    sock = raw(ffn_rank[0])
    read_frame(sock)
    start = time.monotonic()
    sock.sendall(struct.pack("<BI", 6, 2**31))
    assert closed_by_the_ffn_rank(sock) and time.monotonic() - start < 0.9
    the_peer_is_admitted(*ffn_rank)


def test_a_wrong_protocol_version_is_refused_with_the_reason(ffn_rank):
    sock = raw(ffn_rank[0])
    sock.sendall(proven_answer(sock, version=AFD_PROTOCOL_VERSION - 1))
    kind, reason = read_frame(sock)
    assert kind == 8 and f"speaks AFD protocol {AFD_PROTOCOL_VERSION - 1}" in reason.decode()
    the_peer_is_admitted(*ffn_rank)


def test_a_silent_client_is_dropped_after_the_handshake_timeout(ffn_rank):
    sock = raw(ffn_rank[0])
    the_peer_is_admitted(*ffn_rank)  # meanwhile, without waiting for it
    start = time.monotonic()
    assert closed_by_the_ffn_rank(sock)
    assert time.monotonic() - start < 3  # 1 s from its connection


def test_hundreds_of_connections_at_once_do_not_keep_the_peer_out(ffn_rank):
    flood = [raw(ffn_rank[0]) for _ in range(300)]
    the_peer_is_admitted(*ffn_rank)
    for sock in flood:
        sock.close()


def test_a_served_rank_refuses_hostile_input_alone_and_still_answers_standbys(monkeypatch):
    """Once it serves, an FFN rank keeps answering on its port (standbys ask
    it whether they can take its place): garbage, a malformed standby
    request and a silent client are refused alone, within the handshake
    timeout, while a standby gets its answer and the peer stays."""
    monkeypatch.setattr(control_listener, "HANDSHAKE_TIMEOUT_S", 1.0)
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], ONE_PEER, timeout_s=30, secret=SECRET)
    thread, result = serve_in_thread(server)
    peer = ControlClient("127.0.0.1", port, 0, timeout_s=10, secret=SECRET)
    peer.connect(ONE_PEER)
    thread.join(timeout=10)
    assert "error" not in result
    garbage, malformed, silent = raw(port), raw(port), raw(port)
    garbage.sendall(bytes(range(256)) * 8)
    malformed.sendall(proven_answer(malformed))
    assert read_frame(malformed)[0] == 7  # the FFN rank's proof
    malformed.sendall(frame(9, b'{"fingerprint": 7}'))
    start = time.monotonic()
    assert ask_served_rank_as_standby("127.0.0.1", port, ONE_PEER, SECRET)
    assert time.monotonic() - start < 3
    for sock in (garbage, malformed, silent):
        assert closed_by_the_ffn_rank(sock)
    assert server.lost_peers(wait_s=0.2) == []
    peer.close()
    server.close()


@pytest.mark.parametrize("secret", [b"another secret", b""], ids=["wrong", "missing"])
def test_a_wrong_or_missing_secret_is_refused_on_both_sides(ffn_rank, secret, caplog):
    port, thread, result = ffn_rank
    stranger = ControlClient("127.0.0.1", port, 0, timeout_s=10, secret=secret)
    with pytest.raises(AFDConnectionError, match="authentication with the FFN rank at .* failed"):
        stranger.connect(ONE_PEER)
    assert thread.is_alive()  # still serving: its real peer comes next
    the_peer_is_admitted(port, thread, result)


def test_an_ffn_rank_without_the_secret_is_refused_by_the_peer():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], ONE_PEER, timeout_s=3)
    thread, result = serve_in_thread(server)
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10, secret=SECRET)
    with pytest.raises(AFDConnectionError, match="did not prove the shared secret"):
        client.connect(ONE_PEER)
    thread.join(timeout=10)
    server.close()


def test_a_routable_host_needs_a_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_VARIABLE, raising=False)
    with pytest.raises(ValueError, match="not a loopback address.*secret_file"):
        AFDConfig(host="10.1.2.3")
    AFDConfig(host="127.0.0.2")  # loopback needs none
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    assert auth.load_secret(str(secret)) == b"s3cret"
    AFDConfig(host="10.1.2.3", secret_file=str(secret))
    monkeypatch.setenv(auth.SECRET_VARIABLE, "s3cret")
    AFDConfig(host="10.1.2.3")
    with pytest.raises(ValueError, match="secret_file .* cannot be read"):
        AFDConfig(secret_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="secret_file .* is empty"):
        AFDConfig(secret_file=str(tmp_path / "empty"))
