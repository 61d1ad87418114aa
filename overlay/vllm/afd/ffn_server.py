# SPDX-License-Identifier: Apache-2.0
"""``vllm afd-ffn``: start this node's FFN ranks and serve until the attention
side shuts down."""

from __future__ import annotations

import argparse
import multiprocessing

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
    num_ranks = vllm_config.afd_config.num_ffn_ranks
    if num_ranks == 1:
        run_ffn_rank(vllm_config, 0)
        return
    # One process per FFN rank, as vLLM runs one per data-parallel rank.
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=run_ffn_rank, args=(vllm_config, rank), name=f"AFD_FFN_{rank}")
        for rank in range(num_ranks)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = {p.name: p.exitcode for p in procs if p.exitcode != 0}
    if failed:
        raise SystemExit(f"AFD FFN ranks failed: {failed}")
