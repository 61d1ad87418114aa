# SPDX-License-Identifier: Apache-2.0
"""``vllm afd-ffn``: start this node's FFN ranks and serve until the attention
side shuts down."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import tempfile
import threading
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from vllm.afd.ffn.worker import run_ffn_rank
from vllm.afd.platform.cpu_binding import FFNThreadBinding, binds_threads
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

logger = init_logger(__name__)

FFN_CONFIG_EXAMPLE = '--afd-config \'{"role": "ffn", "connector": "gloo"}\''


def ffn_vllm_config(args: argparse.Namespace) -> VllmConfig:
    # Building the config also sets this process up for its role
    # (vllm/afd/platform/process_setup.py): the FFN processes started below
    # inherit that environment.
    vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
    afd = vllm_config.afd_config
    if afd is None or afd.role != "ffn":
        raise ValueError(
            "vllm afd-ffn runs the FFN role: pass an AFD config with role ffn, "
            f"for example {FFN_CONFIG_EXAMPLE}"
        )
    return vllm_config


def run_ffn_server(args: argparse.Namespace) -> None:
    vllm_config = ffn_vllm_config(args)
    afd = vllm_config.afd_config
    group_size = afd.ffn_tensor_parallel_size
    num_processes = afd.num_ffn_ranks * group_size
    # OpenMP reads its binding when it starts, so a bound process is a fresh one.
    if num_processes == 1 and not binds_threads():
        run_ffn_rank(vllm_config, 0)
        return
    # One process per FFN rank and group rank, as vLLM runs one per
    # data-parallel and tensor-parallel rank, each bound as vLLM binds those.
    binding = FFNThreadBinding(num_processes)
    ctx = multiprocessing.get_context("spawn")
    # The groups' rendezvous files, removed once the server is done.
    stores_dir = tempfile.TemporaryDirectory(prefix="afd-ffn-")
    stores = Path(stores_dir.name)
    # The processes hold the read end; this process alone the write end,
    # which closes however it ends.
    lifeline, _lifeline_writer = ctx.Pipe(duplex=False)
    server = (lifeline, os.getpid())
    groups = [
        [
            ctx.Process(
                target=_run_watching_the_server,
                args=(*server, vllm_config, rank, group_rank, stores / f"group{rank}"),
                name=f"AFD_FFN_{rank}" + (f"_TP{group_rank}" if group_size > 1 else ""),
            )
            for group_rank in range(group_size)
        ]
        for rank in range(afd.num_ffn_ranks)
    ]
    for index, proc in enumerate(p for group in groups for p in group):
        with binding.around_start(index):
            proc.start()
    try:
        failed = _join_stopping_failed_groups(groups)
    except KeyboardInterrupt:
        # SIGINT to this process alone (`kill -INT`; a terminal's Ctrl-C
        # reaches the processes too): pass it on, as each stops on its own.
        _interrupt([p for group in groups for p in group])
        raise SystemExit(130) from None
    if failed:
        raise SystemExit(f"AFD FFN processes failed (exit codes): {failed}")


def _run_watching_the_server(lifeline: Connection, server_pid: int, *rank_args) -> None:
    """``run_ffn_rank`` in a process of the server, which ends when the server
    is gone, as vLLM's workers watch their parent: an orphaned FFN rank would
    serve on, unseen, as a second FFN rank for the same peers."""

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        logger.error(
            "AFD FFN rank %d, group rank %d: its server (pid %d) is gone; exiting",
            rank_args[1], rank_args[2], server_pid,
        )  # fmt: skip
        os._exit(1)  # the main thread may sit in a collective that never returns

    threading.Thread(target=watch, name="afd-server-lifeline", daemon=True).start()
    run_ffn_rank(*rank_args)


def _interrupt(processes: list[BaseProcess], grace_s: float = 30.0) -> None:
    """Send SIGINT to the FFN processes still running, wait ``grace_s`` for
    them to stop, then kill the rest."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C changes nothing
    running = [p for p in processes if p.is_alive()]
    for p in running:
        os.kill(p.pid, signal.SIGINT)
    for p in running:
        p.join(timeout=grace_s)
        if p.is_alive():
            logger.error("AFD: %s still runs %.0f s after SIGINT; killing it", p.name, grace_s)
            p.kill()
            p.join()
    logger.info("AFD FFN server: interrupted, stopped its %d process(es)", len(processes))


def _join_stopping_failed_groups(groups: list[list[BaseProcess]]) -> dict[str, int | None]:
    """Wait for every process. When one fails, stop the rest of its FFN rank's
    group: they would wait for it forever (followers for the leader's next
    step, the leader in the group's all-reduce). Other FFN ranks are left to
    end with their attention peers, which learn of the failure from theirs.
    Returns the failed processes' exit codes by name."""
    group_of = {p.name: group for group in groups for p in group}
    running = [p for group in groups for p in group]
    while running:
        wait([p.sentinel for p in running])
        for ended in [p for p in running if not p.is_alive()]:
            running.remove(ended)
            if not ended.exitcode:
                continue
            logger.error("AFD: %s exited with code %s", ended.name, ended.exitcode)
            for p in group_of[ended.name]:
                if p in running:
                    running.remove(p)
                    p.terminate()
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                        p.join()
    return {p.name: p.exitcode for group in groups for p in group if p.exitcode != 0}
