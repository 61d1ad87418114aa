"""Rendezvous, handshake and control plane over real sockets (no engine).

The FFN side (ControlServer) and the attention side (ControlClient) run in
threads of this process; each test bounds its waits with short timeouts.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable

import pytest
from vllm.distributed.afd_transfer.control.client import (
    ControlClient,
    StandbyAnswer,
    ask_served_rank_as_standby,
)
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    AFDHandshakeError,
)
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.resume import PeerPosition, resume_plan
from vllm.distributed.afd_transfer.watchdog import ControlConnectionWatchdog

from vllm_afd_dev.harness.generate import free_port

FINGERPRINT = AFDFingerprint(
    architecture="Qwen3ForCausalLM",
    hidden_size=256,
    dtype="float32",
    num_layers=2,
    num_attention_ranks=2,
    num_ffn_ranks=1,
    ffn_tensor_parallel_size=1,
    ffn_enable_expert_parallel=False,
    connector="gloo",
    compute_gate_on_attention=False,
    cudagraph_mode="NONE",
)


def serve_in_thread(server: ControlServer, data_plane=None, check_devices=lambda _: []):
    result: dict = {}

    def target():
        try:
            result["data_plane"] = server.accept_peers(
                lambda: data_plane or {"store_port": 1}, check_devices
            )
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def test_handshake_then_payloads_in_peer_order():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10)
    assert server._listener.sock.getsockname() == ("127.0.0.1", port)  # bound to host only
    thread, result = serve_in_thread(server, {"store_port": 4242})
    clients = [ControlClient("127.0.0.1", port, rank, timeout_s=10) for rank in (1, 0)]
    welcomes = []
    connectors = [threading.Thread(target=lambda c=c: welcomes.append(c.connect(FINGERPRINT)))
                  for c in clients]  # fmt: skip
    for t in connectors:
        t.start()
    for t in connectors:
        t.join()
    thread.join()
    assert "error" not in result
    assert [w.data_plane for w in welcomes] == [{"store_port": 4242, "ffn_host": "127.0.0.1"}] * 2
    step = ControlPayload(step_id=0, token_counts=((3, 5),))
    for client in clients:
        client.send_payload(step)
    assert server.recv_payloads() == [step, step]
    for client in clients:
        client.close()
    with pytest.raises(
        AFDConnectionError, match="attention rank 0 disconnected without a shutdown"
    ):
        server.recv_payloads()
    server.close()


def test_ffn_parallel_size_mismatch_fails_both_sides():
    """The attention side expects an FFN rank group of two with expert
    parallelism; the FFN rank runs on one device."""
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=10)
    thread, result = serve_in_thread(server)
    expects = {"ffn_tensor_parallel_size": 2, "ffn_enable_expert_parallel": True}
    other = AFDFingerprint(**{**FINGERPRINT.to_dict(), **expects})
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10)
    with pytest.raises(AFDHandshakeError) as attention_error:
        client.connect(other)
    thread.join()
    assert isinstance(result["error"], AFDHandshakeError)
    for message in (str(attention_error.value), str(result["error"])):
        assert "ffn_tensor_parallel_size" in message and "ffn_enable_expert_parallel" in message
    assert "ffn_tensor_parallel_size: ffn=1, attention rank 0=2" in str(result["error"])


def test_mismatch_fails_both_sides_naming_the_fields():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=10)
    thread, result = serve_in_thread(server)
    other = AFDFingerprint(**{**FINGERPRINT.to_dict(), "num_layers": 3, "dtype": "bfloat16"})
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10)
    with pytest.raises(AFDHandshakeError) as attention_error:
        client.connect(other)
    thread.join()
    ffn_error = str(result["error"])
    assert isinstance(result["error"], AFDHandshakeError)
    for message in (str(attention_error.value), ffn_error):
        assert "dtype" in message and "num_layers" in message
        assert "hidden_size" not in message
    assert "num_layers: ffn=2, attention rank 0=3" in ffn_error
    assert "num_layers: attention rank 0=3, ffn=2" in str(attention_error.value)


def test_missing_ffn_rank_is_named_within_the_timeout():
    port = free_port()
    client = ControlClient("127.0.0.1", port, 0, timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(AFDConnectionError, match=f"no FFN rank answered at 127.0.0.1:{port}"):
        client.connect(FINGERPRINT)
    assert time.monotonic() - start < 5


def test_an_ffn_rank_at_another_of_the_hosts_is_found_and_its_host_kept():
    """A replacement at a new address (``failover_hosts``): nothing listens
    at the first host, so the client finds the FFN rank at the second, and
    joins the data plane there."""
    port = free_port()
    server = ControlServer("127.0.0.3", port, [0], FINGERPRINT, timeout_s=10)
    thread, result = serve_in_thread(server)
    client = ControlClient("127.0.0.2", port, 0, timeout_s=10, other_hosts=("127.0.0.3",))
    welcome = client.connect(FINGERPRINT)
    thread.join()
    assert "error" not in result
    assert (client.host, client.address) == ("127.0.0.3", f"127.0.0.3:{port}")
    assert welcome.data_plane["ffn_host"] == "127.0.0.3"
    client.close()
    server.close()
    alone = ControlClient("127.0.0.2", port, 0, timeout_s=1, other_hosts=("127.0.0.4",))
    with pytest.raises(
        AFDConnectionError, match=f"no FFN rank answered at 127.0.0.2:{port} or 127.0.0.4:{port}"
    ):
        alone.connect(FINGERPRINT)  # fmt: skip


def test_missing_attention_rank_is_named_within_the_timeout():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=2)
    thread, result = serve_in_thread(server)
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10)
    start = time.monotonic()
    # The FFN rank answers nobody until rank 1 comes; then it gives up, and
    # the rank that did connect fails too, naming the one that did not.
    with pytest.raises(AFDConnectionError) as attention_error:
        client.connect(FINGERPRINT)
    thread.join()
    assert "refused the connection: attention rank(s) [1] did not connect within 2 s" in (
        str(attention_error.value)
    )
    assert "attention rank(s) [1] did not connect within 2 s" in str(result["error"])
    assert time.monotonic() - start < 5


def connected_pair_of_peers(
    port: int,
    before_they_connect: Callable[[ControlServer], None] = lambda _: None,
    **server_args,
) -> tuple[ControlServer, list[ControlClient]]:
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10, **server_args)
    thread, result = serve_in_thread(server)
    before_they_connect(server)  # the FFN rank waits for its peers meanwhile
    clients = [ControlClient("127.0.0.1", port, rank, timeout_s=10) for rank in (0, 1)]
    connectors = [threading.Thread(target=c.connect, args=(FINGERPRINT,)) for c in clients]
    for t in connectors:
        t.start()
    for t in connectors + [thread]:
        t.join()
    assert "error" not in result
    return server, clients


def test_a_lost_peer_is_named_and_the_others_are_told_why():
    server, (rank0, rank1) = connected_pair_of_peers(free_port())
    told = threading.Event()
    ControlConnectionWatchdog(rank0.socket, told.set, poll_s=0.05).start()
    assert server.lost_peers(wait_s=0.2) == []  # both alive and idle
    assert rank0.stop_notice(wait_s=0.1) is None
    rank1.close()  # what the kernel does when attention rank 1's process dies
    assert server.lost_peers(wait_s=5) == [1]
    server.stop_peers("attention rank(s) [1] disconnected")
    assert told.wait(timeout=5)
    assert rank0.stop_notice(wait_s=0) == "attention rank(s) [1] disconnected"
    server.close()
    assert rank0.stop_notice(wait_s=0) == "attention rank(s) [1] disconnected"  # kept
    rank0.close()


def test_an_ffn_rank_that_closes_without_notice_leaves_none():
    server, (rank0, rank1) = connected_pair_of_peers(free_port())
    server.close()
    assert rank0.stop_notice(wait_s=5) is None
    rank0.close()
    rank1.close()


def test_a_peer_that_said_goodbye_is_not_lost():
    server, clients = connected_pair_of_peers(free_port())
    clients[0].send_payload(ControlPayload.shutdown_message(0))
    clients[0].close()  # shut down first; its peer still has a step to send
    clients[1].send_payload(ControlPayload.shutdown_message(0))
    assert all(p.shutdown for p in server.recv_payloads())
    clients[1].close()
    assert server.lost_peers(wait_s=0.3) == []
    server.close()
    assert server.lost_peers(wait_s=0) == []  # closed by its own side: nobody is lost


@pytest.mark.parametrize("first_to_go", [0, 1])
def test_a_peer_killed_after_the_others_said_goodbye_ends_the_deployment(first_to_go):
    """The end of an offline data-parallel run: one rank shuts down, the other
    is stuck in one more step's collectives until vLLM kills it. Whichever
    of the two the FFN rank reads first, the step is a clean shutdown."""
    server, clients = connected_pair_of_peers(free_port())
    clients[first_to_go].send_payload(ControlPayload.shutdown_message(3))
    clients[first_to_go].close()
    clients[1 - first_to_go].close()  # killed: no shutdown message
    payloads = server.recv_payloads()
    assert [p.shutdown for p in payloads] == [True, True]
    assert {p.step_id for p in payloads} == {3}
    assert server.lost_peers(wait_s=0.3) == []  # the watchdog stays silent too
    server.close()


@pytest.mark.parametrize("killed", [0, 1])
def test_a_peer_killed_before_another_failed_a_step_is_lost(killed):
    """A data-parallel rank is killed mid-run; its peer's next collective
    fails and it shuts down, saying so. Whichever the FFN rank reads first,
    the killed rank is lost, not the deployment's end."""
    server, clients = connected_pair_of_peers(free_port())
    clients[killed].close()
    clients[1 - killed].send_payload(ControlPayload.shutdown_message(3, after_failure=True))
    clients[1 - killed].close()
    with pytest.raises(AFDConnectionError, match=f"attention rank {killed} disconnected without"):
        server.recv_payloads()
    assert server.lost_peers(wait_s=0.3) == [killed]
    server.close()


def test_a_peer_lost_while_another_still_steps_is_an_error():
    server, (rank0, rank1) = connected_pair_of_peers(free_port())
    rank1.send_payload(ControlPayload(step_id=0, token_counts=((3, 5),)))
    rank0.close()  # crashed mid-run: its peer sent a step, not a shutdown
    with pytest.raises(AFDConnectionError, match="attention rank 0 disconnected without"):
        server.recv_payloads()
    assert server.lost_peers(wait_s=0.3) == [0]
    server.close()
    rank1.close()


def test_devices_the_data_plane_cannot_join_fail_both_sides_with_the_reason():
    """The connector sees every peer's device facts (from its hello) and may
    refuse them; every rank fails with that reason, none waits."""
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10)
    seen = {}

    def check(facts):
        seen.update(facts)
        return [f"rank 1 is on {facts[1]['gpu']}, out of reach. Use the nccl connector."]

    thread, result = serve_in_thread(server, check_devices=check)
    errors = {}

    def connect(rank):
        client = ControlClient("127.0.0.1", port, rank, timeout_s=10)
        try:
            client.connect(FINGERPRINT, device_facts={"gpu": f"GPU-{rank}"})
        except AFDConnectionError as e:
            errors[rank] = str(e)

    start = time.monotonic()
    peers = [threading.Thread(target=connect, args=(rank,)) for rank in (0, 1)]
    for t in peers:
        t.start()
    for t in [*peers, thread]:
        t.join(timeout=15)
    assert seen == {0: {"gpu": "GPU-0"}, 1: {"gpu": "GPU-1"}}
    reason = "rank 1 is on GPU-1, out of reach. Use the nccl connector."
    assert f"AFD FFN rank on 127.0.0.1:{port}: {reason}" == str(result["error"])
    for rank in (0, 1):
        assert f"refused the connection: {reason}" in errors[rank]
    assert time.monotonic() - start < 5


def test_a_rank_outside_the_group_is_refused():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=2)
    thread, result = serve_in_thread(server)
    stranger = ControlClient("127.0.0.1", port, 3, timeout_s=5)
    with pytest.raises(AFDHandshakeError, match=r"attention rank 3 is not a peer .*\[0\]"):
        stranger.connect(FINGERPRINT)
    thread.join()
    assert isinstance(result["error"], AFDConnectionError)


def test_a_busy_port_is_a_clear_error():
    port = free_port()
    first = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=1)
    try:
        with pytest.raises(AFDConnectionError, match=f"cannot listen on 127.0.0.1:{port}"):
            ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=1)
    finally:
        first.close()


def test_an_address_of_another_machine_is_a_clear_error():
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: only a standby waits for it.
    with pytest.raises(AFDConnectionError, match="host is not an address of this machine"):
        ControlServer("192.0.2.1", free_port(), [0], FINGERPRINT, timeout_s=1)


def test_an_attempt_connected_to_itself_is_retried(monkeypatch):
    """Before the FFN rank listens, the kernel may give a connection attempt
    the FFN rank's port as its own local port; TCP then connects the socket
    to itself. Forced here (each attempt binds that port) until the server
    is up: the client must not take it for the FFN rank, and must let go of
    the port so the FFN rank can bind it."""
    port = free_port()
    real_create_connection = socket.create_connection
    self_connected = []

    def attempt_from_the_target_port(address, timeout=None):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.settimeout(timeout)
        try:
            sock.bind(address)
            sock.connect(address)
        except OSError:  # the server is up and holds the port
            sock.close()
            return real_create_connection(address, timeout=timeout)
        self_connected.append(sock.getsockname() == sock.getpeername())
        return sock

    monkeypatch.setattr(socket, "create_connection", attempt_from_the_target_port)
    one_peer = dataclasses.replace(FINGERPRINT, num_attention_ranks=1)
    client = ControlClient("127.0.0.1", port, 0, timeout_s=10)
    welcome = {}
    connector = threading.Thread(target=lambda: welcome.update(w=client.connect(one_peer)))
    connector.start()
    deadline = time.monotonic() + 10
    while not self_connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert self_connected and all(self_connected)
    server = ControlServer("127.0.0.1", port, [0], one_peer, timeout_s=10)
    thread, result = serve_in_thread(server)
    connector.join(timeout=15)
    thread.join(timeout=15)
    try:
        assert "error" not in result, result
        assert welcome["w"].data_plane == {"store_port": 1, "ffn_host": "127.0.0.1"}
    finally:
        client.close()
        server.close()


def handshake_resuming_at(resume_steps, positions=(None, None)):
    """The handshake of two peers, each resuming at its step (or, failing
    over in place, at its position), at once. Returns the server, its
    outcome, the clients and each one's outcome."""
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10, num_layers=5)
    thread, result = serve_in_thread(server)
    clients = [ControlClient("127.0.0.1", port, rank, timeout_s=10) for rank in (0, 1)]
    outcomes: list = [None] * len(clients)

    def connect(i):
        try:
            position = positions[i] and (lambda: positions[i])
            outcomes[i] = clients[i].connect(
                FINGERPRINT, resume_step=resume_steps[i], position=position
            )
        except Exception as e:
            outcomes[i] = e

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    thread.join()
    return server, result, clients, outcomes


def test_a_replacement_resumes_the_step_count_its_peers_agree_on():
    server, result, clients, outcomes = handshake_resuming_at([41, 41])
    assert "error" not in result and server.resume_step == 41, (result, outcomes)
    for client in clients:
        client.close()
    server.close()


def test_peers_resuming_at_different_steps_are_refused_with_both_steps():
    _, result, _, outcomes = handshake_resuming_at([41, 40])
    message = r"the attention ranks resume at different steps \{0: 41, 1: 40\}"
    with pytest.raises(AFDConnectionError, match=message):
        raise result["error"]
    for outcome in outcomes:
        with pytest.raises(AFDConnectionError, match=message):
            raise outcome


def test_peers_resuming_in_place_get_the_step_their_plan_starts_at():
    positions = (PeerPosition(41, 4, input_taken=True), PeerPosition(42, 0))
    server, result, clients, outcomes = handshake_resuming_at([0, 0], positions)
    assert "error" not in result, (result, outcomes)
    assert server.resume == resume_plan(list(positions), 5) and server.resume_step == 41
    assert [welcome.data_plane["resume_step"] for welcome in outcomes] == [41, 41]
    for client in clients:
        client.close()
    server.close()


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        ((PeerPosition(41, 2), None), "some attention ranks resume in place and others do not"),
        ((PeerPosition(41, 5), PeerPosition(41, 0)), "resumes past the last of 5 layers"),
    ],
)
def test_resume_positions_that_cannot_be_served_are_refused(positions, message):
    _, result, _, outcomes = handshake_resuming_at([41, 41], positions)
    with pytest.raises(AFDConnectionError, match=message):
        raise result["error"]
    for outcome in outcomes:
        with pytest.raises(AFDConnectionError, match=message):
            raise outcome


def test_a_standby_takes_the_port_once_its_holder_is_gone():
    port = free_port()
    holder = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=10)
    standby: dict = {}
    thread = threading.Thread(
        target=lambda: standby.update(
            server=ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=1, standby=True)
        )
    )
    thread.start()
    time.sleep(2)  # past the bind retries of an FFN rank that is no standby
    assert thread.is_alive() and not standby, "the standby took a port that is held"
    holder.close()
    thread.join(timeout=5)
    assert standby["server"]._listener.sock.getsockname() == ("127.0.0.1", port)
    standby["server"].close()


def test_a_standby_is_checked_against_the_rank_it_backs_before_and_after_its_handshake():
    """A standby asks the FFN rank on its port whether it could take its
    place: while that rank waits for its peers (which still join) and once
    it serves, when it also gets what the rank's endpoint offers (None
    until it has something). A standby that differs is refused at once,
    naming the fields; with nothing on the port there is nothing to check."""
    port = free_port()
    assert ask_served_rank_as_standby("127.0.0.1", port, FINGERPRINT) is None
    offers = iter([None, {"layouts": [[[1, 1]]]}])

    def ask_while_the_rank_waits_for_its_peers(server: ControlServer) -> None:
        answer = ask_served_rank_as_standby("127.0.0.1", port, FINGERPRINT)
        assert answer == StandbyAnswer(None)

    server, clients = connected_pair_of_peers(
        port, ask_while_the_rank_waits_for_its_peers, standby_offer=lambda: next(offers)
    )
    answer = ask_served_rank_as_standby("127.0.0.1", port, FINGERPRINT)
    assert answer == StandbyAnswer({"layouts": [[[1, 1]]]})
    other = dataclasses.replace(FINGERPRINT, num_layers=3, connector="ipc")
    with pytest.raises(AFDHandshakeError, match=r"num_layers: ffn=2, standby=3; connector"):
        ask_served_rank_as_standby("127.0.0.1", port, other)
    server.close()
    for client in clients:
        client.close()


def test_a_standby_with_another_secret_is_refused():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0], FINGERPRINT, timeout_s=2, secret=b"ours")
    thread, result = serve_in_thread(server)
    with pytest.raises(AFDConnectionError, match="authentication with the FFN rank at .* failed"):
        ask_served_rank_as_standby("127.0.0.1", port, FINGERPRINT, secret=b"theirs")
    thread.join()
    assert "did not connect within 2 s" in str(result["error"])  # its peer never came


def test_an_attention_rank_connecting_to_a_served_rank_is_told_why_at_once():
    """Another deployment's attention rank on a port that is served (or a
    peer that restarted) gets the reason, not a wait for its timeout."""
    server, clients = connected_pair_of_peers(free_port())
    port = int(server.address.rsplit(":", 1)[1])
    start = time.monotonic()
    stranger = ControlClient("127.0.0.1", port, 1, timeout_s=30)
    with pytest.raises(AFDConnectionError, match=r"already serves its attention ranks \[0, 1\]"):
        stranger.connect(FINGERPRINT)
    assert time.monotonic() - start < 5
    assert server.lost_peers(wait_s=0.2) == []  # the served peers are untouched
    server.close()
    for client in clients:
        client.close()
