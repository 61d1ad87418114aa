"""MPS for AFD processes that share a GPU (``AFDConfig.mps``), on one H200.

- ``"mps": "start"``: the deployment starts a private MPS control daemon
  before any CUDA context exists; both roles are its clients, the tokens
  equal stock vLLM's with the ipc flag kernels (which ``ipc_signal``
  "auto", the default, picks for MPS clients),
  and the daemon is gone once the process that started it has exited, and
  once the whole deployment was killed.
- the default, ``detect``: both roles on one GPU log their MPS state, and
  warn, with the fix, where MPS is not active; the attention rank signals
  with the flag kernels under MPS and with stream operations without.

The whole GPU suite runs with and without MPS (``scripts/gpu_test_groups.py
--mps``); these tests check what AFD itself does about it.
"""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from vllm.afd.platform.mps import daemon_answers, pipe_directory

from vllm_afd_dev.harness.generate import (
    afd_engine_args,
    default_ipc_signal,
    run,
    spawned_ffn_processes,
    worker_command,
    worker_env,
)
from vllm_afd_dev.harness.gpu_settings import check_step_counters, engine

SETTING = "FULL_DECODE_ONLY"
# Not the daemon a test runner may have started: this deployment starts its own.
OWN_DAEMON = {"CUDA_MPS_PIPE_DIRECTORY": "", "CUDA_VISIBLE_DEVICES": "0"}
STARTED = re.compile(r"started a private MPS control daemon \(pipe directory (\S+), log")


@functools.cache
def stock(model, setting: str = SETTING) -> dict:
    return run(model, engine(setting), stock=True)


def daemon_processes(root: Path) -> list[psutil.Process]:
    """The supervisor and MPS processes of the private daemon under ``root``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        with_root = " ".join(proc.info["cmdline"] or []) + str(proc.info["environ"] or {})
        if str(root) in with_root:
            found.append(proc)
    return found


def wait_until_gone(root: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while root.exists() or daemon_processes(root):
        assert time.monotonic() - start < timeout_s, (
            f"the private MPS daemon under {root} outlived its owner by {timeout_s:.0f} s: "
            f"{[p.info['cmdline'] for p in daemon_processes(root)]}"
        )
        time.sleep(0.5)
    return time.monotonic() - start


def test_mps_start_runs_both_roles_under_a_private_daemon(tiny_qwen3, tmp_path):
    """The default signal, "auto", picks the flag kernels for MPS clients."""
    args = afd_engine_args(
        engine(SETTING), connector="ipc", mps="start", ipc_signal="auto", stats_dir=str(tmp_path)
    )
    afd = run(tiny_qwen3, args, env=OWN_DAEMON)
    log = afd["log"]
    assert "AFD attention rank 0: ipc transfers signal with flag kernels" in log
    pipe_dir = Path(STARTED.search(log).group(1))
    # Both roles are its clients: neither had a CUDA context before it started.
    assert f"MPS client of the control daemon in {pipe_dir}" in log  # attention worker
    ffn_state = re.search(r"AFD FFN rank 0, group rank 0: GPU \d+, (.*)", log).group(1)
    assert ffn_state == f"MPS client of the control daemon in {pipe_dir}"
    assert afd["tokens"] == stock(tiny_qwen3)["tokens"]
    check_step_counters(tmp_path, SETTING)
    # The owner has exited: the daemon and its directories follow.
    print(f"daemon gone {wait_until_gone(pipe_dir.parent, 60):.1f} s after its owner exited")


def test_mps_daemon_stops_after_the_deployment_is_killed(tiny_qwen3):
    """Every process of the deployment killed mid-start (SIGKILL): the one
    that started the daemon, its engine processes (vLLM's engine core
    outlives a killed LLM process, and its clients hold the daemon, which
    must not stop under them) and the spawned FFN rank."""
    args = afd_engine_args(engine("eager"), connector="ipc", mps="start")
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "log"
        with log_path.open("w") as log:
            owner = subprocess.Popen(
                worker_command(tiny_qwen3, args, 200, Path(tmp) / "out.json"),
                env={**worker_env(), **OWN_DAEMON},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while "AFD attention rank 0 connected" not in log_path.read_text():
            assert owner.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the deployment did not connect in 300 s"
            time.sleep(1)
        pipe_dir = Path(STARTED.search(log_path.read_text()).group(1))
        assert daemon_processes(pipe_dir.parent)
        # The daemon's own processes (its supervisor, a child of the owner,
        # and what that started) are left alone: they are what is tested.
        children = psutil.Process(owner.pid).children(recursive=True)
        supervisor = [p for p in children if "mps_supervisor.py" in " ".join(p.cmdline())]
        daemon = supervisor + [c for p in supervisor for c in p.children(recursive=True)]
        deployment = [p for p in children if p not in daemon]
        deployment += spawned_ffn_processes(args["afd_config"]["port"])
        owner.send_signal(signal.SIGKILL)
        for proc in deployment:
            proc.send_signal(signal.SIGKILL)
        owner.wait()
        gone = wait_until_gone(pipe_dir.parent, 60)
        print(f"daemon gone {gone:.1f} s after its deployment was killed")


def test_roles_sharing_a_gpu_report_their_mps_state(tiny_qwen3):
    """The default: both roles on one GPU say whether MPS is active, and
    warn with the fix when it is not."""
    afd = run(tiny_qwen3, afd_engine_args(engine("eager"), connector="ipc"),
              env={"CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
    log = afd["log"]
    pipe_dir = pipe_directory()
    under_mps = daemon_answers(pipe_dir)
    warning = "MPS is not active for them"
    if under_mps:
        assert warning not in log
        assert log.count(f"MPS client of the control daemon in {pipe_dir}") >= 2
    else:
        assert log.count(warning) == 1
        assert "nvidia-cuda-mps-control -d" in log and '"mps": "start"' in log
    # "auto" (the default, unless the run names a signal) spins under MPS only.
    configured = default_ipc_signal() or "auto"
    spins = configured == "kernel" or (configured == "auto" and under_mps)
    how = "flag kernels" if spins else "stream memory operations"
    assert f"AFD attention rank 0: ipc transfers signal with {how}" in log
    assert afd["tokens"] == stock(tiny_qwen3, "eager")["tokens"]
