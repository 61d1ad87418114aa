"""The watchdogs that notice a lost peer while this rank waits on it, and
the asynchronous raise that reaches the thread running the model."""

from __future__ import annotations

import socket
import threading
import time

from vllm.distributed.afd_transfer.handshake import AFDPeerLostError
from vllm.distributed.afd_transfer.watchdog import (
    ControlConnectionWatchdog,
    PeerLossWatchdog,
    raise_in_thread,
)


def watch(poll_s: float = 0.05):
    ours, peer = socket.socketpair()
    lost = threading.Event()
    watchdog = ControlConnectionWatchdog(ours, lost.set, poll_s=poll_s)
    watchdog.start()
    return watchdog, peer, lost


def test_a_closed_control_connection_is_reported():
    _, peer, lost = watch()
    time.sleep(0.2)
    assert not lost.is_set()  # an idle, open connection is fine
    peer.close()  # what the kernel does when the FFN process dies
    assert lost.wait(timeout=5)


def test_ffn_side_polls_its_peers_until_one_is_lost():
    lost_now: list[int] = []
    reported = threading.Event()
    found: list[list[int]] = []
    watchdog = PeerLossWatchdog(
        lambda wait_s: list(lost_now), lambda ranks: (found.append(ranks), reported.set()), 0.05
    )
    watchdog.start()
    assert not reported.wait(timeout=0.3)
    lost_now.append(1)
    assert reported.wait(timeout=5)
    assert found == [[1]]


def test_ffn_side_ignores_a_peer_seen_closed_once():
    """One poll may fall between the FFN thread reading a peer's shutdown
    message and recording it: that peer is not lost."""
    polls = iter([[1]])  # closed in one poll, then recorded as finished
    reported = threading.Event()
    watchdog = PeerLossWatchdog(lambda wait_s: next(polls, []), lambda ranks: reported.set(), 0.05)
    watchdog.start()
    assert not reported.wait(timeout=0.5)
    watchdog.stop()


def test_a_stopped_watchdog_stays_quiet():
    watchdog, peer, lost = watch()
    watchdog.stop()
    peer.close()
    assert not lost.wait(timeout=0.5)


def test_the_error_reaches_a_thread_blocked_in_a_loop():
    caught: list[BaseException] = []
    started = threading.Event()

    def model_thread() -> None:
        started.set()
        try:
            while True:  # stands for a step whose GPU wait just returned
                time.sleep(0.01)
        except AFDPeerLostError as e:
            caught.append(e)

    thread = threading.Thread(target=model_thread, daemon=True)
    thread.start()
    started.wait()
    assert raise_in_thread(thread.ident, AFDPeerLostError)
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert "a peer rank was lost; see the error logged above" in str(caught[0])
