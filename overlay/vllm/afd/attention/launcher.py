# SPDX-License-Identifier: Apache-2.0
"""``spawn_ffn``: the attention side starts the local FFN ranks itself.

The FFN ranks run ``vllm afd-ffn`` in a child process with the attention
side's model settings and the same AFD config (role switched to "ffn"), so
one ``LLM(...)``, ``vllm serve`` or ``vllm bench`` runs both roles. The child
ends when the attention side sends shutdown or its connection closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.afd.platform.cpu_binding import without_worker_binding
from vllm.afd.platform.mps import check_gpu_sharing
from vllm.distributed.afd_transfer.handshake import AFDConnectionError, AFDPeerGoneError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.afd import AFDConfig

logger = init_logger(__name__)


def ffn_command(vllm_config: VllmConfig) -> list[str]:
    """The ``vllm afd-ffn`` command line matching this attention deployment."""
    model = vllm_config.model_config
    afd = vllm_config.afd_config
    assert afd is not None
    gpus = torch.cuda.device_count() if vllm_config.device_config.device_type == "cuda" else 0
    afd_json = ffn_side_afd_config(afd, vllm_config.parallel_config.tensor_parallel_size, gpus)
    load = vllm_config.load_config
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "afd-ffn",
        model.model,
        "--tokenizer",
        model.tokenizer,
        "--dtype",
        str(model.dtype).removeprefix("torch."),
        "--max-model-len",
        str(model.max_model_len),
        "--max-num-batched-tokens",
        str(vllm_config.scheduler_config.max_num_batched_tokens),
        "--load-format",
        str(load.load_format),
        "--seed",
        str(model.seed),
        "--afd-config",
        json.dumps(afd_json),
    ]
    if model.revision:
        cmd += ["--revision", model.revision]
    if model.trust_remote_code:
        cmd.append("--trust-remote-code")
    if model.hf_overrides:
        cmd += ["--hf-overrides", json.dumps(model.hf_overrides)]
    if model.quantization:
        cmd += ["--quantization", str(model.quantization)]
    if load.download_dir:
        cmd += ["--download-dir", load.download_dir]
    if vllm_config.parallel_config.disable_custom_all_reduce:
        cmd.append("--disable-custom-all-reduce")
    if model.enforce_eager:
        cmd.append("--enforce-eager")
    else:
        cmd += ["--compilation-config", json.dumps(ffn_compilation_config(vllm_config))]
    return cmd


def ffn_side_afd_config(afd: AFDConfig, attention_tp_size: int, num_gpus: int) -> dict[str, Any]:
    """The FFN side's AFD config, as JSON: this side's, as the FFN role. When
    the ``num_gpus`` visible GPUs hold a GPU for every process of both roles,
    the FFN processes take the ones after the attention ranks' (each rank
    spans ``attention_tp_size``); otherwise the FFN side's default shares
    them (``ffn_first_device``)."""
    # Every field carries over, so a new AFDConfig field cannot be forgotten here.
    afd_json = {f.name: getattr(afd, f.name) for f in dataclasses.fields(afd)}
    # The attention side checks MPS for every process it places
    # (check_spawned_placement); the FFN processes inherit its MPS settings.
    afd_json.update(role="ffn", spawn_ffn=False, mps="off")
    attention_gpus = afd.num_attention_ranks * attention_tp_size
    ffn_gpus = afd.num_ffn_ranks * afd.ffn_tensor_parallel_size
    if afd.ffn_first_device is None and attention_gpus + ffn_gpus <= num_gpus:
        afd_json.update(ffn_first_device=attention_gpus)
    return afd_json


def check_spawned_placement(afd: AFDConfig, attention_tp_size: int, num_gpus: int) -> None:
    """On GPUs: when this node's processes of both roles outnumber its GPUs,
    some share one, which wants MPS."""
    processes = (
        afd.num_attention_ranks * attention_tp_size
        + afd.num_ffn_ranks * afd.ffn_tensor_parallel_size
    )
    if afd.mps != "off" and num_gpus and processes > num_gpus:
        check_gpu_sharing(
            f"spawn_ffn places this deployment's {processes} processes (attention and FFN) "
            f"on {num_gpus} GPU(s)",
            torch.cuda.current_device(),
        )


def ffn_compilation_config(vllm_config: VllmConfig) -> dict:
    """The attention side's graph mode, and its choice between vLLM's own
    kernels and their torch versions (the FFN rank runs its layers without
    torch.compile, where that choice decides which kernel runs): the FFN
    then computes exactly what the colocated model's FFN would."""
    compilation = vllm_config.compilation_config
    return {
        "cudagraph_mode": compilation.cudagraph_mode.name,
        "mode": int(compilation.mode),
        "custom_ops": list(compilation.custom_ops),
    }


# Runs in a short-lived intermediate process: starts the FFN command, hands it
# the write end of the liveness pipe, writes the FFN's pid there, and exits.
_DETACH = (
    "import os, subprocess, sys; fd = int(sys.argv[1]); "
    "os.write(fd, b'%d\\n' % subprocess.Popen(sys.argv[2:], pass_fds=(fd,)).pid)"
)


class FFNProcess:
    """The process that runs this deployment's FFN ranks, started detached.

    The FFN ranks serve every attention rank, so they must not die with the
    engine of the one that started them: vLLM stops an engine that outlives
    its shutdown grace by killing its whole process tree, and the FFN would
    then be killed before the other attention ranks are done (or, if one of
    them died, before it could tell the rest which one). So an intermediate
    process starts it and exits at once. It still ends with its peers: when
    all of them have shut down or been lost, or after ``timeout_s`` if they
    never connect. A pipe whose write end only the FFN process holds tells
    this side when it has exited.
    """

    def __init__(self, cmd: list[str], timeout_s: float) -> None:
        self.cmd = cmd
        self.timeout_s = timeout_s
        logger.info("AFD: starting the FFN ranks: %s", " ".join(cmd))
        # The FFN ranks are no data-parallel ranks: an offline DP rank's
        # VLLM_DP_* settings would make them join the attention side's DP group.
        # On CPU they bind their threads themselves, not as this worker is bound.
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_")}
        env = without_worker_binding(env)
        self._alive, alive_w = os.pipe()
        try:
            starter = subprocess.run(
                [sys.executable, "-c", _DETACH, str(alive_w), *cmd],
                env=env,
                pass_fds=(alive_w,),
                timeout=60,
            )
        finally:
            os.close(alive_w)
        self._pending = b""
        self.pid: int | None = None
        """The FFN process; None if its start was cut short (see below)."""
        if starter.returncode == 0:
            self.pid = int(self._read_line())
        elif starter.returncode < 0:
            # Killed by a signal while it started the FFN process: that counts
            # as an FFN process that died while it started, which check_alive
            # reports and failover replaces. A pid it wrote still names a
            # process that runs.
            logger.warning(
                "AFD: the process that starts the FFN process was killed (signal %d)",
                -starter.returncode,
            )
            if select.select([self._alive], [], [], 0)[0]:
                self._pending = os.read(self._alive, 64)  # b"" if none ever started
                if self._pending:
                    self.pid = int(self._read_line())
        else:
            raise AFDConnectionError(
                f"AFD: could not start the FFN process for spawn_ffn (exit code "
                f"{starter.returncode}); its error is above. Command: " + " ".join(cmd)
            )

    def _read_line(self) -> bytes:
        while b"\n" not in self._pending:
            chunk = os.read(self._alive, 64)
            if not chunk:
                break
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _exited(self, wait_s: float) -> bool:
        readable, _, _ = select.select([self._alive], [], [], wait_s)
        return bool(readable) and os.read(self._alive, 64) == b""

    def check_alive(self) -> None:
        if self._exited(0):
            raise AFDPeerGoneError(
                "AFD: the FFN process started by spawn_ffn exited before it accepted "
                "connections; its log is above. Command: " + " ".join(self.cmd)
            )

    def wait(self) -> None:
        """Wait for the FFN process to end after shutdown; stop it if it does
        not end in time."""
        if not self._exited(self.timeout_s):
            logger.warning("AFD: the FFN process did not exit after shutdown; terminating it")
            self._signal(signal.SIGTERM)
            if not self._exited(10):
                self._signal(signal.SIGKILL)
        os.close(self._alive)

    def kill(self) -> None:
        """End a process that was lost: it may hang rather than have died."""
        if not self._exited(0):
            self._signal(signal.SIGKILL)
            self._exited(10)
        os.close(self._alive)

    def _signal(self, sig: signal.Signals) -> None:
        # A start cut short before the pid was written leaves none to signal:
        # that process, if it runs, ends with its peers as any FFN process does.
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class SpawnedFFN:
    """The FFN process of ``spawn_ffn``: the first, then, with
    ``failover_timeout_s``, each one started in a lost one's place."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        afd = vllm_config.afd_config
        assert afd is not None
        if vllm_config.device_config.device_type == "cuda":
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            check_spawned_placement(afd, tp_size, torch.cuda.device_count())
        self._cmd = ffn_command(vllm_config)
        self._timeout_s = afd.timeout_s
        self.process = FFNProcess(self._cmd, self._timeout_s)

    def check_alive(self) -> None:
        self.process.check_alive()

    def restart(self) -> Callable[[], None]:
        """Start a new FFN process in the lost one's place; returns the check
        that it still runs, for the wait until it accepts connections."""
        self.process.kill()
        logger.warning("AFD: starting an FFN process in the lost one's place")
        self.process = FFNProcess(self._cmd, self._timeout_s)
        return self.check_alive

    def wait(self) -> None:
        self.process.wait()
