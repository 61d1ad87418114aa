# SPDX-License-Identifier: Apache-2.0
"""Noticing, from a thread, that the FFN rank stopped.

With a device connector (ipc, nccl) the attention rank's GPU waits for the
FFN rank inside kernels or graph replays, and its host thread waits on the
GPU; if the FFN process dies, nothing raises. With gloo the transfer fails
by itself, but only the FFN rank knows why it stopped: it may have lost
another attention rank. After the handshake the FFN rank writes on its
control connection only a stop notice, just before it exits, so that
connection turning readable means the FFN rank is gone: the
``ControlConnectionWatchdog`` watches for exactly that (the connector then
reads the notice), and ``raise_in_thread`` delivers the error to the thread
that runs the model once its wait returns.
"""

from __future__ import annotations

import ctypes
import select
import socket
import threading
from collections.abc import Callable


class _Watchdog:
    """A daemon thread that runs ``_run`` until ``stop``."""

    def __init__(self, poll_s: float, name: str) -> None:
        self._poll_s = poll_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join: bool = False) -> None:
        """Stop watching; with ``join``, also wait until a loss being handled
        (``on_lost`` runs in this thread) is done."""
        self._stopped.set()
        if join and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class ControlConnectionWatchdog(_Watchdog):
    """Calls ``on_lost`` once if the FFN rank sends a stop notice or closes
    ``sock`` before ``stop``."""

    def __init__(self, sock: socket.socket, on_lost: Callable[[], None], poll_s: float = 1.0):
        super().__init__(poll_s, "afd-watchdog")
        self._sock = sock
        self._on_lost = on_lost

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], self._poll_s)
            except (OSError, ValueError):  # closed here: replaced after a failover
                return
            if self._stopped.is_set():
                return
            if readable:
                self._on_lost()
                return


class PeerLossWatchdog(_Watchdog):
    """FFN side: calls ``on_lost(ranks)`` once when ``lost_peers(0)`` names
    attention ranks whose connection closed without a shutdown message, in
    two polls running. It polls, because the FFN rank's own thread reads
    those connections; twice, because that thread may be between reading a
    peer's shutdown message and recording it when the peer closes."""

    def __init__(
        self,
        lost_peers: Callable[[float], list[int]],
        on_lost: Callable[[list[int]], None],
        poll_s: float = 0.5,
    ):
        super().__init__(poll_s, "afd-peer-watchdog")
        self._lost_peers = lost_peers
        self._on_lost = on_lost

    def _run(self) -> None:
        seen: set[int] = set()
        while not self._stopped.wait(self._poll_s):
            now = set(self._lost_peers(0.0))
            lost = sorted(now & seen)
            if lost and not self._stopped.is_set():
                self._on_lost(lost)
                return
            seen = now


def raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` in another Python thread, at its next bytecode
    (a thread blocked in a C call, such as a CUDA synchronize that released
    the GIL, raises when that call returns). True if the thread exists."""
    return (
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread_id), ctypes.py_object(exc_type)
        )
        == 1
    )
