# SPDX-License-Identifier: Apache-2.0
"""NVIDIA MPS for AFD processes that share a GPU.

Without MPS the GPU time-slices between the contexts of processes that share
it, and every AFD exchange between two such processes waits for a context
switch: about 290 us per layer round trip on an H200, against about 9 us
with an MPS control daemon, whose clients' kernels run side by side, so
that the ipc transfers can spin on their flags (docs/performance.md). So
wherever processes of a deployment share a GPU, AFD says whether MPS is on
(``AFDConfig.mps``):

- ``detect`` (default): log the processes' MPS state, and one warning with
  the cost and the fix when they share a GPU without it;
- ``start``: the process that builds the deployment's config starts a
  private control daemon (its own pipe and log directories) in its process
  set-up (``process_setup``), before any CUDA context of the deployment
  exists, and its children join it; a supervisor stops it when that process
  ends, also after a crash or a kill;
- ``off``: no check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm.afd.platform.mps_supervisor import daemon_answers
from vllm.distributed.afd_transfer.afd_connector.gpus import is_mps_client
from vllm.logger import init_logger

logger = init_logger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_DIR_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIR_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PERCENTAGE_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
_START_TIMEOUT_S = 30.0
_SUPERVISOR = Path(__file__).with_name("mps_supervisor.py")

_warned = False
_supervisor: subprocess.Popen | None = None
_keep_open: list[int] = []  # the lifeline's write end, held for this process's lifetime


class MPSStartError(RuntimeError):
    """``mps: start`` could not bring up a control daemon."""


def pipe_directory() -> str:
    """Where this process's CUDA driver looks for an MPS control daemon."""
    return os.environ.get(PIPE_DIR_VARIABLE) or DEFAULT_PIPE_DIR


def describe_mps(device_index: int = 0) -> str:
    client = is_mps_client(device_index)
    if client is None:
        return "MPS state unknown (the CUDA driver bindings cannot tell)"
    if client:
        return f"MPS client of the control daemon in {pipe_directory()}"
    return "not under MPS (the GPU time-slices between processes)"


def check_gpu_sharing(sharing: str, device_index: int = 0) -> None:
    """``sharing`` describes processes of this deployment that share a GPU
    with this one. Logs this process's MPS state; warns once per process
    when they share it without MPS."""
    global _warned
    client = is_mps_client(device_index)
    if client:
        logger.info("AFD: %s; %s", sharing, describe_mps(device_index))
        return
    if _warned:
        return
    _warned = True
    logger.warning(
        "AFD: %s, %s. Each AFD exchange between processes that share a GPU then "
        "waits for the GPU to switch contexts: about 290 us per layer round trip on an "
        "H200, against about 9 us under MPS. Start an MPS control daemon before the "
        "deployment (`nvidia-cuda-mps-control -d`, stop it with `echo quit | "
        "nvidia-cuda-mps-control`), or let AFD start a private one: "
        '--afd-config \'{"mps": "start", ...}\'. Set "mps": "off" to silence this.',
        sharing,
        describe_mps(device_index)
        if client is None
        else "and MPS is not active for them (no control daemon in " + pipe_directory() + ")",
    )


def describe_shared_gpus(ffn_rank: int, own_gpu: str, peer_gpus: dict[int, str]) -> str | None:
    """Which of an FFN rank's processes share a GPU: the FFN rank (on
    ``own_gpu``) and its attention peers (``peer_gpus`` by rank, GPU UUIDs);
    None where each has a GPU of its own."""
    by_gpu: dict[str, list[str]] = {}
    by_gpu.setdefault(own_gpu, []).append(f"FFN rank {ffn_rank}")
    for rank, gpu in sorted(peer_gpus.items()):
        by_gpu.setdefault(gpu, []).append(f"attention rank {rank}")
    shared = [f"{' and '.join(names)} share GPU {gpu}" for gpu, names in by_gpu.items()
              if len(names) > 1]  # fmt: skip
    return "; ".join(shared) or None


def ensure_private_daemon() -> str:
    """``mps: start``: make sure an MPS control daemon serves the processes
    this one starts, and return its pipe directory.

    A daemon that ``CUDA_MPS_PIPE_DIRECTORY`` names and that answers is
    joined: an FFN side spawned by an attention side that started one, or
    an engine process whose parent did, inherits that setting. Otherwise a
    supervisor process starts ``nvidia-cuda-mps-control -f`` with private
    pipe and log directories, and this process's environment points its
    future children there. Call it before any CUDA context exists in this
    process: the driver reads the setting when it initialises."""
    global _supervisor
    inherited = os.environ.get(PIPE_DIR_VARIABLE)
    if inherited and daemon_answers(inherited):
        return inherited
    binary = shutil.which(CONTROL_BINARY)
    if binary is None:
        raise MPSStartError(
            f'AFD "mps": "start" needs {CONTROL_BINARY}, which is not on PATH (it comes '
            "with the NVIDIA driver, often in /usr/local/nvidia/bin or /usr/bin). Add its "
            'folder to PATH, or start MPS yourself and use "mps": "detect"'
        )
    root = Path(tempfile.mkdtemp(prefix="afd-mps-"))
    ready_r, ready_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()
    # The supervisor runs as a script, importing nothing of vLLM, in a
    # session of its own: a Ctrl-C or a kill of this process group must leave
    # it alive to stop the daemon once this process is gone.
    _supervisor = subprocess.Popen(
        [sys.executable, str(_SUPERVISOR), binary, str(root), str(lifeline_r), str(ready_w)],
        pass_fds=(lifeline_r, ready_w),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    os.close(lifeline_r)
    os.close(ready_w)
    # Only this process holds the write end: the supervisor reads EOF when it
    # exits, however it exits.
    os.set_inheritable(lifeline_w, False)
    status = _read_status(ready_r, _START_TIMEOUT_S)
    os.close(ready_r)
    if status != "ready":
        os.close(lifeline_w)
        raise MPSStartError(
            f'AFD "mps": "start": the MPS control daemon did not start ({status}). '
            "Check that no other MPS daemon owns the GPU in exclusive mode "
            "(nvidia-smi -q | grep 'Compute Mode'), or start one yourself and use "
            '"mps": "detect"'
        )
    pipe_dir, log_dir = str(root / "pipe"), str(root / "log")
    os.environ[PIPE_DIR_VARIABLE] = pipe_dir
    os.environ[LOG_DIR_VARIABLE] = log_dir
    _keep_open.append(lifeline_w)
    logger.info(
        "AFD: started a private MPS control daemon (pipe directory %s, log %s/control.log); "
        "it stops when this process (pid %d) ends",
        pipe_dir,
        log_dir,
        os.getpid(),
    )
    return pipe_dir


def _read_status(fd: int, timeout_s: float) -> str:
    import select

    readable, _, _ = select.select([fd], [], [], timeout_s)
    if not readable:
        return f"no answer from its supervisor within {timeout_s:.0f} s"
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip() or "its supervisor exited without a word"


def verify_mps_mode(mode: str, device_type: str) -> None:
    """``AFDConfig.mps`` against the device (pydantic has checked the value):
    ``start`` runs on GPUs only. The daemon itself is started by the process
    set-up (``vllm.afd.platform.process_setup``)."""
    if mode == "start" and device_type != "cuda":
        raise ValueError(
            f'AFD "mps": "start" shares NVIDIA GPUs between processes, but this engine runs '
            f'on {device_type}; remove it (or use "detect")'
        )


def verify_active_thread_percentage(device_type: str) -> None:
    """``AFDConfig.mps_active_thread_percentage``, when set, against the
    device: it splits NVIDIA GPUs only."""
    if device_type != "cuda":
        raise ValueError(
            "AFD mps_active_thread_percentage splits NVIDIA GPUs' SMs between processes "
            f"under MPS, but this engine runs on {device_type}; remove it"
        )


def set_active_thread_percentage(percentages: dict[str, int], role: str) -> None:
    """``AFDConfig.mps_active_thread_percentage``: this process's share of the
    GPU's SMs, for the context it has yet to create. Processes that this one
    starts inherit the setting, so a role left out clears it: a spawned FFN
    rank must not run with the attention side's share."""
    if role in percentages:
        os.environ[THREAD_PERCENTAGE_VARIABLE] = str(percentages[role])
    else:
        os.environ.pop(THREAD_PERCENTAGE_VARIABLE, None)
    logger.info(
        "AFD: this %s process may use %s%% of the GPU's SMs under MPS (%s)",
        role,
        percentages.get(role, 100),
        THREAD_PERCENTAGE_VARIABLE,
    )
