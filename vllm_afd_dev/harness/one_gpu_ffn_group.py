"""``vllm afd-ffn`` with every process of an FFN rank group on one GPU.

A test placement, not a deployment shape: it lets FFN groups (tensor and
expert parallelism, eager and with CUDA graphs) run where one GPU is lent
(tests/gpu/test_afd_gpu_ffn_group.py). NCCL, which carries the group's
collectives, refuses two ranks of one host on one GPU, so each process of
the group names a host of its own and NCCL joins them over loopback
sockets, as the one-GPU data-parallel placement does (``generate.own_nccl_host``).
vLLM's custom all-reduce needs a GPU per process: pass
``--disable-custom-all-reduce``.

Usage: python -m vllm_afd_dev.harness.one_gpu_ffn_group MODEL [vllm afd-ffn arguments]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import vllm.afd.ffn.server
from vllm.afd.ffn.worker import run_ffn_rank


def run_ffn_rank_as_its_own_host(
    vllm_config, ffn_rank: int, group_rank: int = 0, group_store: Path | None = None
) -> None:
    """``run_ffn_rank``, with NCCL told that this process is a host of its own
    (before NCCL starts: it reads these once)."""
    os.environ.update(NCCL_HOSTID=f"afd-ffn-{ffn_rank}-{group_rank}", NCCL_SOCKET_IFNAME="lo")
    run_ffn_rank(vllm_config, ffn_rank, group_rank, group_store)


# The server's processes call vllm.afd.ffn.server.run_ffn_rank. They are
# spawned: each imports this module again, as "__mp_main__", before it runs,
# so the replacement is made here at import, in them as in the server.
vllm.afd.ffn.server.run_ffn_rank = run_ffn_rank_as_its_own_host

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "afd-ffn", *sys.argv[1:]]
    main()
