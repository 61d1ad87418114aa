# SPDX-License-Identifier: Apache-2.0
"""Supervisor of a private MPS control daemon (``AFDConfig.mps = "start"``).

Run as a script by ``vllm.afd.platform.mps.ensure_private_daemon``, in a session of
its own and importing nothing of vLLM:

    python mps_supervisor.py CONTROL_BINARY ROOT LIFELINE_FD READY_FD

It starts ``CONTROL_BINARY -f`` with pipe and log directories under ROOT,
writes "ready" (or why not) to READY_FD once the daemon answers, then waits
for end-of-file on LIFELINE_FD: the process that started it holds the only
write end, so EOF means that process has ended, however it ended. Then it
asks the daemon to quit (MPS lets running clients finish first), kills it if
it has not quit in time, and removes ROOT.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 20.0
QUIT_TIMEOUT_S = 30.0


def daemon_answers(pipe_dir: str | os.PathLike[str]) -> bool:
    """Whether an MPS control daemon listens in ``pipe_dir`` (a killed
    daemon leaves its socket file behind, which then refuses connections).
    Defined here, in the module that imports nothing of vLLM, for the
    supervisor and for ``vllm.afd.platform.mps`` alike."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(os.path.join(pipe_dir, "control"))
        except OSError:
            return False
    return True


def start_daemon(binary: str, pipe_dir: Path, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """The daemon, and "ready" or why it is not."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
           "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}  # fmt: skip
    log = (log_dir / "control.log").open("ab")
    # A process group of its own, so that stopping it reaches its MPS server too.
    daemon = subprocess.Popen(
        [binary, "-f"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            return daemon, f"{binary} -f exited with code {daemon.returncode}: {log_tail(log_dir)}"
        if daemon_answers(pipe_dir):
            return daemon, "ready"
        time.sleep(0.05)
    return daemon, f"{binary} -f did not answer within {START_TIMEOUT_S:.0f} s: {log_tail(log_dir)}"


def log_tail(log_dir: Path) -> str:
    return (log_dir / "control.log").read_text(errors="replace").strip()[-500:]


def stop_daemon(binary: str, daemon: subprocess.Popen, pipe_dir: Path) -> None:
    if daemon.poll() is None:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
        try:
            subprocess.run([binary], input=b"quit\n", env=env, timeout=10, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            daemon.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    if daemon.poll() is None:
        try:
            os.killpg(daemon.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        daemon.wait()


def main() -> int:
    binary, root = sys.argv[1], Path(sys.argv[2])
    lifeline, ready = int(sys.argv[3]), int(sys.argv[4])
    # Ctrl-C in the terminal and a hang-up reach the whole foreground group
    # only if this process is in it; ignore them anyway: it ends on the
    # lifeline alone, after its owner.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pipe_dir, log_dir = root / "pipe", root / "log"
    daemon, status = None, "not started"
    try:
        pipe_dir.mkdir(mode=0o700)
        log_dir.mkdir(mode=0o700)
        daemon, status = start_daemon(binary, pipe_dir, log_dir)
        os.write(ready, status.encode() + b"\n")
        os.close(ready)
        if status == "ready":
            while not (select.select([lifeline], [], [])[0] and os.read(lifeline, 64) == b""):
                pass
    finally:
        if daemon is not None:
            stop_daemon(binary, daemon, pipe_dir)
        shutil.rmtree(root, ignore_errors=True)
    return 0 if status == "ready" else 1


if __name__ == "__main__":
    # SIGTERM (e.g. a container stopping) also stops the daemon first.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    raise SystemExit(main())
