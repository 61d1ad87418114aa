"""A peer's liveness on the control plane comes from the peer's host, not from
how long the peer takes.

The FFN side's ``ControlServer`` and the attention side's ``ControlClient``
run on two network-namespace hosts (``net_hosts``), each in a process of its
own, connected and idle, as between steps or while a peer compiles:

- the FFN process is frozen (SIGSTOP) for twice ``liveness_s``, the
  deployment's ``timeout_s``: its kernel still answers, so neither side
  reports anything. A peer that merely takes long is not lost;
- then the FFN host vanishes from the network (its link goes down, nothing
  closes): both sides report the other lost within ``liveness_s``.

Needs root (network namespaces); CI runs as root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import sys
import time

import pytest
from test_afd_control import FINGERPRINT as CONTROL_FINGERPRINT

from vllm_afd_dev.harness.net_hosts import Hosts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

LIVENESS_S = 6.0
PORT = 29700
FINGERPRINT = dataclasses.replace(CONTROL_FINGERPRINT, num_attention_ranks=1)

# Each side prints "connected", then "lost at T: why" when it takes its peer for lost.
FFN_SIDE = """
import json, sys, time
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.handshake import AFDFingerprint
host, port, liveness, fingerprint = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
server = ControlServer(host, port, [0], AFDFingerprint(**json.loads(fingerprint)),
                       timeout_s=60, liveness_s=liveness)
server.accept_peers(lambda: {"store_port": 1}, lambda facts: [])
print("connected", flush=True)
try:
    server.recv_payloads()
    print("a payload", flush=True)
except Exception as e:
    print(f"lost at {time.time()}: {e}", flush=True)
"""
ATTENTION_SIDE = """
import json, sys, threading, time
from vllm.distributed.afd_transfer.control.client import ControlClient
from vllm.distributed.afd_transfer.handshake import AFDFingerprint
from vllm.distributed.afd_transfer.watchdog import ControlConnectionWatchdog
host, port, liveness, fingerprint = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
client = ControlClient(host, port, 0, timeout_s=60, liveness_s=liveness)
client.connect(AFDFingerprint(**json.loads(fingerprint)))
lost = threading.Event()
ControlConnectionWatchdog(client.socket, lost.set, poll_s=0.1).start()
print("connected", flush=True)
lost.wait()
print(f"lost at {time.time()}: the watchdog fired", flush=True)
"""


class Side:
    """One side's process on its host, and the lines it has printed."""

    def __init__(self, hosts: Hosts, host: str, code: str) -> None:
        args = [hosts.address["ffn"], str(PORT), str(LIVENESS_S),
                json.dumps(dataclasses.asdict(FINGERPRINT))]  # fmt: skip
        self.proc = hosts.start(host, [sys.executable, "-c", code, *args])
        self.lines: list[str] = []
        self._partial = b""

    def read(self, until: float) -> None:
        """Collect lines until the monotonic time ``until`` or the process ends."""
        fd = self.proc.stdout.fileno()  # read unbuffered: select sees what is left
        while (left := until - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                return
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            *complete, self._partial = (self._partial + chunk).split(b"\n")
            self.lines += [line.decode().strip() for line in complete]

    def lost_at(self) -> float | None:
        found = [line for line in self.lines if line.startswith("lost at ")]
        return float(found[0].split()[2].rstrip(":")) if found else None


@pytest.fixture
def pair():
    hosts = Hosts()
    sides = []
    try:
        sides.append(Side(hosts, "ffn", FFN_SIDE))
        sides.append(Side(hosts, "head", ATTENTION_SIDE))  # it retries until the FFN side listens
        deadline = time.monotonic() + 120
        for side in sides:
            while "connected" not in side.lines and time.monotonic() < deadline:
                side.read(min(deadline, time.monotonic() + 1))
                assert side.proc.poll() is None or "connected" in side.lines, side.lines
            assert "connected" in side.lines, side.lines
        yield hosts, *sides
    finally:
        for side in sides:
            side.proc.send_signal(signal.SIGCONT)
            side.proc.kill()
            side.proc.wait(timeout=30)
        hosts.close()


def test_a_frozen_peer_is_waited_for_and_a_vanished_host_is_lost_in_time(pair):
    hosts, ffn, attention = pair
    ffn.proc.send_signal(signal.SIGSTOP)
    attention.read(time.monotonic() + 2 * LIVENESS_S)
    ffn.proc.send_signal(signal.SIGCONT)
    ffn.read(time.monotonic() + 1)
    assert attention.lost_at() is None, attention.lines
    assert ffn.lost_at() is None, ffn.lines

    unplugged = time.time()
    hosts.unplug("ffn")
    until = time.monotonic() + LIVENESS_S + 10
    for side in (attention, ffn):
        while side.lost_at() is None and time.monotonic() < until:
            side.read(until)
    for name, side in (("attention", attention), ("ffn", ffn)):
        assert side.lost_at() is not None, (name, side.lines)
        noticed = side.lost_at() - unplugged
        print(f"{name} side took its peer for lost {noticed:.1f} s after the unplug")
        assert noticed <= LIVENESS_S, (name, noticed, side.lines)
    assert "disconnected without a shutdown message" in ffn.lines[-1]
