"""A benchmark configuration's processes are all gone before the next one
starts: the worker's session is waited for, and what outlives the wait is
killed (vllm_afd_dev.bench.sessions)."""

from __future__ import annotations

import subprocess
import sys
import time

from vllm_afd_dev.bench.sessions import kill_session, session_processes, wait_for_session_to_end

# A worker that starts a detached process (as AFD starts its FFN process) and
# exits at once, printing its child's pid.
SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"
DETACHING_WORKER = (
    "import subprocess, sys; "
    f"print(subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, sys.argv[1]]).pid)"
)


def start_worker(child_s: float) -> tuple[int, int]:
    worker = subprocess.Popen(
        [sys.executable, "-c", DETACHING_WORKER, str(child_s)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = int(worker.stdout.readline())
    worker.wait()
    return worker.pid, child


def test_the_process_a_worker_left_is_waited_for():
    session, child = start_worker(child_s=1.5)
    assert session_processes(session) == [child]
    started = time.monotonic()
    assert wait_for_session_to_end(session, timeout_s=30, what="test") == []
    assert time.monotonic() - started > 0.5
    assert session_processes(session) == []


def test_a_process_that_outlives_the_wait_is_killed(capsys):
    session, child = start_worker(child_s=120)
    assert wait_for_session_to_end(session, timeout_s=1, what="row x") == [child]
    assert session_processes(session) == []
    assert "row x: 1 process(es) still ran 1 s after it ended" in capsys.readouterr().out


def test_a_killed_session_leaves_no_process():
    session, child = start_worker(child_s=120)
    kill_session(session)
    assert session_processes(session) == []
