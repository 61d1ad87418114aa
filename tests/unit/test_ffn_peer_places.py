"""FFN side: attention ranks that are deployments of their own
(``attention_rank``). The places' bookkeeping (``PeerPlaces``), the control
server that reads whichever peers announce a step, drops a lost one and
welcomes a restarted one back (real sockets, threads of this process), and
the gloo data plane that serves the other peers on and forms a new group of
two at a restarted peer's place (real gloo groups, threads of this process).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from vllm.config.afd import AFDConfig
from vllm.distributed.afd_transfer.afd_connector.base import DataPlaneSpec, StepExchange
from vllm.distributed.afd_transfer.afd_connector.gloo_connector import GlooDataPlane
from vllm.distributed.afd_transfer.control.client import ControlClient
from vllm.distributed.afd_transfer.control.peers import FINISHED, LOST, SERVED, PeerPlaces
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.handshake import AFDConnectionError, AFDFingerprint
from vllm.distributed.afd_transfer.payload import ControlPayload, PayloadError

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


def serve_in_thread(server: ControlServer) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target():
        try:
            result["data_plane"] = server.accept_peers(lambda: {"store_port": 1})
        except Exception as e:  # noqa: BLE001 - the test reads it
            result["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def step(step_id: int, *counts: int, **flags: bool) -> ControlPayload:
    return ControlPayload(step_id=step_id, token_counts=(tuple(counts),), **flags)


# ------------------------------------------------------------------ PeerPlaces
def test_ready_peers_are_served_together_each_with_its_own_column():
    places = PeerPlaces([4, 5])
    places.announce(4, step(0, 3, 0))
    merged, payloads = places.next_step(step_id=7)
    assert merged.token_counts == ((3, 0),) and merged.step_id == 7 and list(payloads) == [4]
    assert places.next_step(step_id=8) is None  # nothing announced
    places.announce(5, step(0, 0, 2))
    places.announce(4, step(1, 1, 0))
    merged, payloads = places.next_step(step_id=8)
    assert merged.token_counts == ((1, 2),) and sorted(payloads) == [4, 5]
    assert (places.next_step_of(4), places.next_step_of(5)) == (2, 1)


def test_steps_of_another_kind_wait_for_a_step_of_their_own():
    places = PeerPlaces([0, 1])
    places.announce(1, step(0, 0, 8, is_profile=True))  # waits longest
    places.announce(0, step(0, 2, 0))
    first, payloads = places.next_step(0)
    assert first.is_profile and list(payloads) == [1] and first.token_counts == ((0, 8),)
    assert places.waiting_to_announce() == [1]  # rank 0's step is still to serve
    second, payloads = places.next_step(1)
    assert not second.is_profile and list(payloads) == [0]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (step(1, 3, 0), "announced step 1, expected 0: the roles are out of step"),
        (step(0, 3, 4), r"must announce its own tokens only, as peer 0 of 2"),
        (step(0, 3), r"must announce its own tokens only"),
    ],
)
def test_a_step_out_of_order_or_with_another_peers_tokens_is_an_error(payload, message):
    with pytest.raises(PayloadError, match=message):
        PeerPlaces([0, 1]).announce(0, payload)


def test_a_lost_place_is_not_served_and_takes_a_restarted_rank_back():
    places = PeerPlaces([0, 1], resume_steps={1: 40})
    places.announce(0, step(0, 3, 0))
    places.lose(0)  # what it announced dies with it
    assert places.state(0) == LOST and places.lost == [0] and places.served == [1]
    assert places.next_step(0) is None
    with pytest.raises(ValueError, match="served already"):
        places.rejoin(1)
    places.rejoin(0)  # a restart counts from 0 again
    places.announce(0, step(0, 2, 0))
    places.announce(1, step(40, 0, 1))
    merged, _ = places.next_step(0)
    assert merged.token_counts == ((2, 1),)


def test_the_places_finish_with_their_shutdown_messages():
    places = PeerPlaces([0, 1])
    places.announce(0, ControlPayload.shutdown_message(0))
    assert places.state(0) == FINISHED and not places.all_finished()
    assert places.waiting_to_announce() == [1]
    places.announce(1, ControlPayload.shutdown_message(0))
    assert places.all_finished() and places.next_step(0) is None
    places.rejoin(0)
    assert places.state(0) == SERVED


# ------------------------------------------------------------- ControlServer
def separate_peers(keep_places: bool = True) -> tuple[ControlServer, list[ControlClient]]:
    port = free_port()
    server = ControlServer(
        "127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10, keep_places=keep_places
    )
    thread, result = serve_in_thread(server)
    clients = [ControlClient("127.0.0.1", port, rank, timeout_s=10, separate=True)
               for rank in (0, 1)]  # fmt: skip
    connectors = [threading.Thread(target=c.connect, args=(FINGERPRINT,)) for c in clients]
    for t in connectors:
        t.start()
    for t in connectors + [thread]:
        t.join()
    assert "error" not in result, result
    assert server.places is not None
    return server, clients


def read_until(server: ControlServer, done, timeout_s: float = 5.0) -> list[int]:
    lost: list[int] = []
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        lost += server.read_announcements(wait_s=0.05)
    assert done()
    return lost


def test_the_ffn_rank_serves_whichever_peer_has_a_step_and_drops_a_lost_one():
    server, (rank0, rank1) = separate_peers()
    rank0.send_payload(step(0, 3, 0))
    read_until(server, lambda: server.places.waiting_to_announce() == [1])
    merged, _ = server.places.next_step(0)  # rank 1 idles: not waited for
    assert merged.token_counts == ((3, 0),)
    rank0.close()  # what the kernel does when attention rank 0's process dies
    assert read_until(server, lambda: server.places.lost == [0]) == [0]
    assert server.lost_peers(wait_s=0) == [0]
    rank1.send_payload(step(0, 0, 4))
    read_until(server, lambda: server.places.waiting_to_announce() == [])
    merged, payloads = server.places.next_step(1)
    assert merged.token_counts == ((0, 4),) and list(payloads) == [1]
    assert rank1.stop_notice(wait_s=0.1) is None  # rank 1 was told nothing
    server.close()
    rank1.close()


@pytest.mark.parametrize("loss_seen_first", [True, False])
def test_a_restarted_rank_is_welcomed_back_at_its_place_through_the_handshake(loss_seen_first):
    server, (rank0, rank1) = separate_peers()
    port = int(server.address.rsplit(":", 1)[1])
    rank0.close()
    if loss_seen_first:
        read_until(server, lambda: server.places.lost == [0])
    dropped = []
    restarted = ControlClient("127.0.0.1", port, 0, timeout_s=10, separate=True)
    welcome: dict = {}
    joined = []
    connector = threading.Thread(
        target=lambda: welcome.update(w=restarted.connect(FINGERPRINT, resume_step=0))
    )
    connector.start()
    deadline = time.monotonic() + 5
    admitted: list[int] = []
    while not admitted and time.monotonic() < deadline:
        admitted = server.admit_returning(
            lambda peer: {"store_prefix": f"place{peer}"},
            lambda peer, data_plane: joined.append((peer, data_plane)),
            dropped.append,
        )
        time.sleep(0.05)
    connector.join()
    assert admitted == [0] and joined == [(0, {"store_prefix": "place0"})]
    assert dropped == ([] if loss_seen_first else [0])  # a restart before its loss was seen
    assert welcome["w"].data_plane == {"store_prefix": "place0", "ffn_host": "127.0.0.1"}
    assert server.places.served == [0, 1] and server.lost_peers(wait_s=0) == []
    restarted.send_payload(step(0, 2, 0))
    rank1.send_payload(step(0, 0, 1))
    read_until(server, lambda: server.places.waiting_to_announce() == [])
    assert server.places.next_step(5)[0].token_counts == ((2, 1),)
    # A second rank 1 while rank 1 is served is told why at once.
    with pytest.raises(AFDConnectionError, match="attention rank 1 is served already"):
        ControlClient("127.0.0.1", port, 1, timeout_s=10, separate=True).connect(FINGERPRINT)
    server.close()
    for client in (restarted, rank1):
        client.close()


def test_without_failover_a_lost_peer_of_its_own_stops_the_ffn_rank_naming_it():
    server, (rank0, rank1) = separate_peers(keep_places=False)
    port = int(server.address.rsplit(":", 1)[1])
    rank1.close()
    with pytest.raises(
        AFDConnectionError, match="attention rank 1 disconnected without a shutdown"
    ):
        read_until(server, lambda: False, timeout_s=2)
    with pytest.raises(AFDConnectionError, match="does not keep a lost attention rank's place"):
        server.places.lose(1)  # as the endpoint's stop would leave it
        ControlClient("127.0.0.1", port, 1, timeout_s=10, separate=True).connect(FINGERPRINT)
    server.close()
    rank0.close()


def test_a_peer_killed_after_the_others_finished_is_the_deployments_end():
    server, (rank0, rank1) = separate_peers(keep_places=False)
    rank0.send_payload(ControlPayload.shutdown_message(0))
    read_until(server, lambda: server.places.state(0) == FINISHED)
    rank1.close()
    read_until(server, server.places.all_finished)
    server.close()


def test_peers_of_their_own_and_data_parallel_peers_do_not_mix():
    port = free_port()
    server = ControlServer("127.0.0.1", port, [0, 1], FINGERPRINT, timeout_s=10)
    thread, result = serve_in_thread(server)
    clients = [ControlClient("127.0.0.1", port, rank, timeout_s=10, separate=rank == 0)
               for rank in (0, 1)]  # fmt: skip
    errors = []

    def connect(client):
        try:
            client.connect(FINGERPRINT)
        except AFDConnectionError as e:
            errors.append(str(e))

    connectors = [threading.Thread(target=connect, args=(c,)) for c in clients]
    for t in connectors:
        t.start()
    for t in connectors + [thread]:
        t.join()
    assert len(errors) == 2 and all("attention ranks [0] are deployments of their own" in e
                                    for e in errors + [str(result["error"])])  # fmt: skip


# ------------------------------------------------------------ gloo data plane
WIDTH = 8


def gloo_plane(role: str, rank: int) -> GlooDataPlane:
    afd = AFDConfig(role=role, num_attention_ranks=2, timeout_s=5, startup_timeout_s=20)
    spec = DataPlaneSpec(afd, role, rank, 0, (0, 1), 1, WIDTH, WIDTH, torch.float32, 64)
    exchange = StepExchange(local_address="127.0.0.1", transfer_timeout_s=5)
    return GlooDataPlane(spec, exchange)


def reached(description: dict) -> dict:
    """The FFN rank's data-plane description as an attention rank's
    ``ControlClient`` hands it on: with the host where it reached the rank."""
    return {**description, "ffn_host": "127.0.0.1"}


def in_threads(*calls) -> None:
    errors = []

    def run(call):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def exchange(ffn: GlooDataPlane, peers: dict[int, GlooDataPlane], counts: tuple[int, ...]):
    """One layer: each peer sends rows of its index + 1, the FFN rank
    doubles them; returns what each peer got back and what the FFN got."""
    got: dict[int, torch.Tensor] = {}
    received: list[torch.Tensor] = []

    def peer(index: int) -> None:
        rows = torch.full((counts[index], WIDTH), float(index + 1))
        peers[index].send_hidden_states(rows, 0, 0)
        out = torch.empty_like(rows)
        peers[index].recv_ffn_output(out, 0, 0)
        got[index] = out

    def serve() -> None:
        received.extend(ffn.recv_hidden_states(0, 0, counts))
        ffn.send_ffn_output([2 * rows for rows in received], 0, 0)

    in_threads(serve, *[lambda i=i: peer(i) for i in peers])
    return got, received


def test_gloo_serves_the_other_peer_on_and_takes_a_restarted_one_back():
    ffn = gloo_plane("ffn", 0)
    peers = {i: gloo_plane("attention", i) for i in (0, 1)}
    ffn.serve_on_after_loss = True
    welcome = ffn.serve()
    in_threads(lambda: ffn.join(welcome),
               *[lambda p=p: p.join(reached(welcome)) for p in peers.values()])  # fmt: skip
    got, _ = exchange(ffn, peers, (2, 3))
    assert torch.equal(got[0], torch.full((2, WIDTH), 2.0))
    assert torch.equal(got[1], torch.full((3, WIDTH), 4.0))

    peers.pop(0).close()  # its process died: its pair of sockets closes
    got, received = exchange(ffn, peers, (2, 3))
    assert torch.equal(received[0], torch.zeros(2, WIDTH))  # never served
    assert torch.equal(got[1], torch.full((3, WIDTH), 4.0))
    assert ffn.take_failed_peers() == [0] and ffn.take_failed_peers() == []
    ffn.drop_peer(0)

    got, _ = exchange(ffn, peers, (0, 1))  # peer 1 alone
    assert torch.equal(got[1], torch.full((1, WIDTH), 4.0))

    place = ffn.open_place(0)
    assert place["store_prefix"] != welcome["store_prefix"]
    peers[0] = gloo_plane("attention", 0)
    in_threads(lambda: ffn.join_place(0, place), lambda: peers[0].join(reached(place)))
    got, _ = exchange(ffn, peers, (4, 1))
    assert torch.equal(got[0], torch.full((4, WIDTH), 2.0))
    assert torch.equal(got[1], torch.full((1, WIDTH), 4.0))
    for plane in (ffn, *peers.values()):
        plane.close()


def test_without_serving_on_a_lost_peer_fails_the_step_naming_it():
    ffn = gloo_plane("ffn", 0)
    peers = {i: gloo_plane("attention", i) for i in (0, 1)}
    welcome = ffn.serve()
    in_threads(lambda: ffn.join(welcome),
               *[lambda p=p: p.join(reached(welcome)) for p in peers.values()])  # fmt: skip
    peers.pop(1).close()
    with pytest.raises(AFDConnectionError, match=r"lost attention ranks \[1\] while receiving"):
        ffn.recv_hidden_states(0, 0, (0, 2))
    for plane in (ffn, *peers.values()):
        plane.close()
