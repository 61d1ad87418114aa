"""The FFN process of ``spawn_ffn`` (``vllm/afd/attention/launcher.py``).

It is started through a short-lived process that detaches it. A signal that
kills that starter while it works makes an FFN process that died while it
started, which failover replaces, never an error that ends the deployment;
a starter that fails by itself (a command that cannot run) stays an error.
Each case runs the real starter, whose code a test may end with a SIGKILL
of its own: a kill from outside lands at a moment no test can pick.
"""

from __future__ import annotations

import sys
import time

import psutil
import pytest
from vllm.afd.attention import launcher
from vllm.distributed.afd_transfer.handshake import AFDConnectionError, AFDPeerGoneError

FFN_COMMAND = [sys.executable, "-c", "import time; time.sleep(120)"]
"""Stands in for `vllm afd-ffn`: the launcher only starts, watches and ends it."""
SIGKILL_ITSELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def ended(process: psutil.Process, wait_s: float = 5) -> bool:
    """Whether ``process`` has exited within ``wait_s`` (its pipe closes a
    moment before the kernel marks it as exited)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # reparented, not yet reaped
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("starter_ends", ["by exiting", "killed after starting it"])
def test_a_started_ffn_process_runs_until_it_is_killed(starter_ends, monkeypatch):
    if starter_ends == "killed after starting it":
        monkeypatch.setattr(launcher, "_DETACH", f"{launcher._DETACH}; {SIGKILL_ITSELF}")
    process = launcher.FFNProcess(FFN_COMMAND, timeout_s=5)
    ffn = psutil.Process(process.pid)
    assert ffn.cmdline() == FFN_COMMAND
    process.check_alive()
    process.kill()
    assert ended(ffn)


def test_a_starter_killed_before_it_starts_anything_is_an_ffn_process_that_died_starting(
    monkeypatch,
):
    monkeypatch.setattr(launcher, "_DETACH", SIGKILL_ITSELF)
    process = launcher.FFNProcess(FFN_COMMAND, timeout_s=5)
    assert process.pid is None
    with pytest.raises(AFDPeerGoneError, match="exited before it accepted connections"):
        process.check_alive()
    process.kill()


def test_a_command_that_cannot_start_is_an_error():
    with pytest.raises(AFDConnectionError, match="could not start the FFN process") as error:
        launcher.FFNProcess(["/nonexistent/python", "-c", "pass"], timeout_s=5)
    assert not isinstance(error.value, AFDPeerGoneError)
