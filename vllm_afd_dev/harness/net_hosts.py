"""Hosts for tests: network namespaces on a bridge of their own.

Nothing is added to the machine's own network: each "host" is a namespace
with one veth into a switch namespace; their addresses exist only there.
Needs root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from vllm_afd_dev.harness.generate import worker_env


class Hosts:
    """Namespaces ``afd<pid>-<name>`` on a bridge in a namespace of its own."""

    NAMES = ("head", "headless", "ffn", "spare")

    def __init__(self) -> None:
        tag = f"afd{os.getpid()}"
        self.switch = f"{tag}-sw"
        subnet = 16 + os.getpid() % 200
        self.ns = {name: f"{tag}-{name}" for name in self.NAMES}
        self.address = {name: f"10.{subnet}.0.{i + 1}" for i, name in enumerate(self.NAMES)}
        self.service_address = f"10.{subnet}.0.100"
        """An address of no host at first, for a service that moves between
        hosts (a virtual IP): ``add_address``, ``move_address``."""
        self._ip("netns", "add", self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.NAMES):
            ns, port = self.ns[name], f"p{i}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", "eth0", "netns", ns, "type", "veth",
                     "peer", "name", port, "netns", self.switch)  # fmt: skip
            self._ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def start(
        self, name: str, args: list[str], log: Path | None = None, **env: str
    ) -> subprocess.Popen:
        """Runs ``args`` on host ``name``, its output to ``log`` (else a text
        pipe); gloo and vLLM take its address."""
        host_env = {**worker_env(), "GLOO_SOCKET_IFNAME": "eth0",
                    "VLLM_HOST_IP": self.address[name], **env}  # fmt: skip
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns[name], *args],
            stdout=log.open("w") if log else subprocess.PIPE, stderr=subprocess.STDOUT,
            env=host_env, text=True,
        )  # fmt: skip

    def python(self, name: str, code: str, *args: str, timeout: float = 60) -> str:
        proc = subprocess.run(
            ["ip", "netns", "exec", self.ns[name], sys.executable, "-c", code, *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    def kill(self, name: str) -> None:
        """The host dies: every process in its namespace, at once."""
        pids = subprocess.run(["ip", "netns", "pids", self.ns[name]], capture_output=True,
                              text=True, check=True).stdout.split()  # fmt: skip
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def unplug(self, name: str) -> None:
        """The host vanishes from the network: its link goes down and nothing
        closes, so no FIN or RST reaches its peers."""
        self._ip("-n", self.switch, "link", "set", f"p{self.NAMES.index(name)}", "down")

    def plug(self, name: str) -> None:
        """The host comes back on the network (after ``unplug``)."""
        self._ip("-n", self.switch, "link", "set", f"p{self.NAMES.index(name)}", "up")

    def add_address(self, name: str, address: str) -> None:
        """Host ``name`` takes ``address`` as well as its own."""
        self._ip("-n", self.ns[name], "addr", "add", f"{address}/32", "dev", "eth0")

    def move_address(self, address: str, source: str, target: str) -> None:
        """What a virtual-IP manager (keepalived) does when ``source`` fails:
        ``address`` moves to ``target``, and the other hosts forget where it
        was (its gratuitous ARP)."""
        self._ip("-n", self.ns[source], "addr", "del", f"{address}/32", "dev", "eth0")
        self.add_address(target, address)
        for name in self.NAMES:
            if name not in (source, target):
                self._ip("-n", self.ns[name], "neigh", "flush", "dev", "eth0")

    def close(self) -> None:
        for name in self.NAMES:
            self.kill(name)
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
