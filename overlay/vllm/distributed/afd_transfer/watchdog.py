# SPDX-License-Identifier: Apache-2.0
"""Noticing a lost peer while the GPU waits on it.

With a device connector (ipc, nccl) the attention rank's GPU waits for the
FFN rank inside kernels or graph replays, and its host thread waits on the
GPU; if the FFN process dies, nothing raises. The FFN rank never writes on
its control connection after the handshake, so that connection turning
readable means it closed: the ``ControlConnectionWatchdog`` watches for
exactly that from a thread, and ``raise_in_thread`` delivers the error to
the thread that runs the model once its wait returns.
"""

from __future__ import annotations

import ctypes
import select
import socket
import threading
from collections.abc import Callable


class ControlConnectionWatchdog:
    """Calls ``on_lost`` once if the peer closes ``sock`` before ``stop``."""

    def __init__(self, sock: socket.socket, on_lost: Callable[[], None], poll_s: float = 1.0):
        self._sock = sock
        self._on_lost = on_lost
        self._poll_s = poll_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _peer_closed(self) -> bool:
        try:
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _run(self) -> None:
        while not self._stopped.is_set():
            readable, _, _ = select.select([self._sock], [], [], self._poll_s)
            if self._stopped.is_set():
                return
            if readable:
                if self._peer_closed():
                    self._on_lost()
                return  # the peer wrote after the handshake: not ours to read


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
