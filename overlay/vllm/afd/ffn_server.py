# SPDX-License-Identifier: Apache-2.0
"""``vllm afd-ffn``: start this node's FFN ranks and serve until the attention
side shuts down."""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from vllm.afd.ffn_worker import run_ffn_rank
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

logger = init_logger(__name__)

FFN_CONFIG_EXAMPLE = '--afd-config \'{"role": "ffn", "connector": "gloo"}\''


def ffn_vllm_config(args: argparse.Namespace) -> VllmConfig:
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
    if afd.num_ffn_ranks == 1 and afd.ffn_tensor_parallel_size == 1:
        run_ffn_rank(vllm_config, 0)
        return
    # One process per FFN rank and group rank, as vLLM runs one per
    # data-parallel and tensor-parallel rank.
    ctx = multiprocessing.get_context("spawn")
    stores = Path(tempfile.mkdtemp(prefix="afd-ffn-"))
    group_size = afd.ffn_tensor_parallel_size
    procs = [
        ctx.Process(
            target=run_ffn_rank,
            args=(vllm_config, rank, group_rank, stores / f"group{rank}"),
            name=f"AFD_FFN_{rank}" + (f"_TP{group_rank}" if group_size > 1 else ""),
        )
        for rank in range(afd.num_ffn_ranks)
        for group_rank in range(group_size)
    ]
    for proc in procs:
        proc.start()
    failed = _join_or_stop_all(procs)
    if failed:
        raise SystemExit(f"AFD FFN processes failed: {failed}")


def _join_or_stop_all(procs: list[BaseProcess]) -> dict[str, int | None]:
    """Wait for every process; when one fails, stop the rest (a group's
    followers would otherwise wait for a leader that is gone). Returns the
    failed ones' exit codes by name."""
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        running = [p for p in running if p.is_alive()]
        if any(p.exitcode for p in procs if not p.is_alive()):
            for p in running:
                p.terminate()
            for p in running:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            break
    return {p.name: p.exitcode for p in procs if p.exitcode != 0}
