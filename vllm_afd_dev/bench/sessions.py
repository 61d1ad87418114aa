"""Every process a benchmark configuration started, gone before the next
one starts.

A configuration's worker runs in a session of its own (``subprocess.Popen(...,
start_new_session=True)``), and so does everything it starts: vLLM's engine
core and the FFN process AFD starts detached, which outlives the worker by
as long as its shutdown takes. Until it has exited, the GPU memory it holds
(an FFN rank of Qwen3-30B-A3B: 56 GiB) is not free for the next
configuration's engine, whose start-up check then fails (seen on an H100:
"Free memory on device cuda:0 (22.36/79.18 GiB) on startup is less than
desired"). Linux only (``/proc``), as are the GPU benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def session_processes(session: int) -> list[int]:
    """The live processes of ``session`` (zombies left out)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone since the listing
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces.
        state, _ppid, _pgrp, sid = text[text.rindex(")") + 2 :].split()[:4]
        if int(sid) == session and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def wait_for_session_to_end(session: int, timeout_s: float, what: str) -> list[int]:
    """Wait up to ``timeout_s`` for every process of ``session`` to exit,
    then kill those left (saying so, as ``what``'s). Returns the killed pids."""
    deadline = time.monotonic() + timeout_s
    while left := session_processes(session):
        if time.monotonic() >= deadline:
            print(f"{what}: {len(left)} process(es) still ran {timeout_s:.0f} s after it ended "
                  f"(pids {left}); killing them", flush=True)  # fmt: skip
            kill_session(session)
            return left
        time.sleep(0.2)
    return []


def kill_session(session: int, wait_s: float = 10) -> None:
    """SIGKILL every process of ``session``; wait up to ``wait_s`` for them to go."""
    for pid in session_processes(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.1)
