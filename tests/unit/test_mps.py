"""``AFDConfig.mps``: its values, and the private MPS daemon's lifecycle.

This machine has no NVIDIA driver, so the real ``nvidia-cuda-mps-control``
runs only in the GPU tests (tests/gpu/test_afd_gpu_mps.py). Here a stand-in
with the same command line (``-f`` serves the control socket in
``$CUDA_MPS_PIPE_DIRECTORY``, a plain call passes ``quit`` to it) drives
the supervisor that AFD starts: ready, owner killed, daemon stopped and its
directories removed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllm.afd.platform import mps, mps_supervisor
from vllm.config import AFDConfig
from vllm.engine.arg_utils import EngineArgs

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import os, socket, sys
    path = os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control")
    if sys.argv[1:] == ["-f"]:
        if os.environ.get("STAND_IN_FAILS"):
            sys.exit("An instance of this daemon is already running")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(path)
        server.listen()
        while True:
            conn, _ = server.accept()
            if conn.recv(64).startswith(b"quit"):
                os.unlink(path)
                sys.exit(0)
            conn.close()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(path)
    client.sendall(sys.stdin.buffer.read())
    """
)


@pytest.fixture
def stand_in_path(tmp_path: Path) -> str:
    binary = tmp_path / "bin" / mps.CONTROL_BINARY
    binary.parent.mkdir()
    binary.write_text(STAND_IN.format(python=sys.executable))
    binary.chmod(0o755)
    return f"{binary.parent}{os.pathsep}{os.environ['PATH']}"


def start_owner(path: str, **env: str) -> subprocess.Popen:
    """A process that starts a private daemon, prints its pipe directory
    (or its error) and waits to be stopped."""
    code = (
        "import sys, time; from vllm.afd.platform import mps\n"
        "try: print('pipe:', mps.ensure_private_daemon(), flush=True)\n"
        "except mps.MPSStartError as e: print('error:', e, flush=True); sys.exit(3)\n"
        "time.sleep(600)"
    )
    env = {**os.environ, "PATH": path, "CUDA_MPS_PIPE_DIRECTORY": "", **env}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )


def pipe_dir_of(owner: subprocess.Popen) -> Path:
    for line in owner.stdout:
        if line.startswith("pipe: "):
            return Path(line.removeprefix("pipe: ").strip())
    raise AssertionError(f"the owner exited with {owner.wait()} before its daemon was ready")


def wait_gone(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while path.exists():
        assert time.monotonic() < deadline, f"{path} still there after {timeout_s} s"
        time.sleep(0.1)


def test_a_bad_mps_value_is_refused():
    with pytest.raises(ValueError, match="Input should be 'detect', 'start' or 'off'"):
        AFDConfig(mps="always")


def test_mps_start_on_cpu_is_refused(tiny_qwen3):
    args = EngineArgs(model=str(tiny_qwen3), afd_config={"mps": "start"})
    with pytest.raises(ValueError, match=r'"mps": "start" shares NVIDIA GPUs .* runs on cpu'):
        args.create_engine_config()


def test_an_sm_split_on_cpu_is_refused(tiny_qwen3):
    split = {"mps_active_thread_percentage": {"ffn": 50}}
    args = EngineArgs(model=str(tiny_qwen3), afd_config=split)
    with pytest.raises(ValueError, match="splits NVIDIA GPUs' SMs .* runs on cpu; remove it"):
        args.create_engine_config()


def test_each_role_sets_its_sm_share_and_a_role_left_out_clears_the_inherited_one(monkeypatch):
    monkeypatch.setenv(mps.THREAD_PERCENTAGE_VARIABLE, "")  # restored when the test ends
    monkeypatch.delenv(mps.THREAD_PERCENTAGE_VARIABLE)
    mps.set_active_thread_percentage({"attention": 30}, "attention")
    assert os.environ[mps.THREAD_PERCENTAGE_VARIABLE] == "30"
    # A spawned FFN rank inherits the attention side's setting; it has none of its own.
    mps.set_active_thread_percentage({"attention": 30}, "ffn")
    assert mps.THREAD_PERCENTAGE_VARIABLE not in os.environ
    mps.set_active_thread_percentage({"attention": 30, "ffn": 70}, "ffn")
    assert os.environ[mps.THREAD_PERCENTAGE_VARIABLE] == "70"


def test_mps_start_without_the_control_binary_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "")
    with pytest.raises(mps.MPSStartError, match="nvidia-cuda-mps-control, which is not on PATH"):
        mps.ensure_private_daemon()


def test_private_daemon_stops_when_its_owner_is_killed(stand_in_path):
    owner = start_owner(stand_in_path)
    pipe_dir = pipe_dir_of(owner)
    assert pipe_dir.name == "pipe" and mps.daemon_answers(str(pipe_dir))
    assert (pipe_dir.parent / "log").is_dir()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    wait_gone(pipe_dir.parent)  # the stand-in got "quit", the directories are removed


def test_a_daemon_that_fails_to_start_is_a_clear_error(stand_in_path):
    owner = start_owner(stand_in_path, STAND_IN_FAILS="1")
    message = owner.stdout.read()
    assert owner.wait(30) == 3
    assert "the MPS control daemon did not start" in message
    assert "An instance of this daemon is already running" in message


def test_a_live_inherited_daemon_is_joined_not_duplicated(stand_in_path, monkeypatch):
    owner = start_owner(stand_in_path)
    try:
        pipe_dir = str(pipe_dir_of(owner))
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
        assert mps.ensure_private_daemon() == pipe_dir
    finally:
        owner.kill()
        owner.wait()
    wait_gone(Path(pipe_dir).parent)
    # Its socket file gone or dead, the same setting no longer counts as a daemon.
    assert not mps.daemon_answers(pipe_dir)


def test_the_supervisor_and_the_runtime_probe_a_daemon_alike():
    assert mps.daemon_answers is mps_supervisor.daemon_answers


def test_shared_gpus_are_named():
    assert mps.describe_shared_gpus(0, "GPU-a", {0: "GPU-b", 1: "GPU-c"}) is None
    assert (
        mps.describe_shared_gpus(0, "GPU-a", {0: "GPU-a", 1: "GPU-b", 2: "GPU-b"})
        == "FFN rank 0 and attention rank 0 share GPU GPU-a; "
        "attention rank 1 and attention rank 2 share GPU GPU-b"
    )


def test_sharing_without_mps_warns_once_with_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(mps, "_warned", False)
    monkeypatch.setattr(mps, "is_mps_client", lambda index=0: False)
    monkeypatch.setattr(mps.logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger=mps.logger.name):
        mps.check_gpu_sharing("FFN rank 0 and attention rank 0 share GPU GPU-a")
        mps.check_gpu_sharing("FFN rank 0 and attention rank 0 share GPU GPU-a")
    (record,) = caplog.records
    text = record.getMessage()
    assert "290 us per layer" in text and "nvidia-cuda-mps-control -d" in text
    assert '"mps": "start"' in text and "MPS is not active" in text
