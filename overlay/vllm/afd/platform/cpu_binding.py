# SPDX-License-Identifier: Apache-2.0
"""OpenMP thread binding of the FFN processes on CPU, by vLLM's own rule.

vLLM binds each CPU worker's OpenMP threads as ``VLLM_CPU_OMP_THREADS_BIND``
says: ``auto`` (one NUMA node per local worker), ``nobind``, or one core list
per local worker separated by ``|``. The FFN side follows the same setting
over its own processes: F FFN ranks x T group ranks, in that order (rank 0's
group, then rank 1's). vLLM applies it by setting OpenMP's environment around
each worker's start; so does the FFN server, around each FFN process's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch
from vllm import envs
from vllm.platforms import current_platform
from vllm.utils.ompmultiprocessing import OMPProcessManager

# What vLLM's OMPProcessManager sets for one worker. An attention worker that
# starts the FFN side (spawn_ffn) holds its own binding in these; the FFN
# processes must not inherit it.
WORKER_BINDING_ENV = (
    "OMP_NUM_THREADS",
    "OMP_PLACES",
    "OMP_PROC_BIND",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "KMP_TPAUSE",
    "GOMP_CPU_AFFINITY",
)


def binds_threads() -> bool:
    """Whether vLLM binds CPU workers' threads here (a CPU platform whose
    ``VLLM_CPU_OMP_THREADS_BIND`` is not ``nobind``)."""
    return current_platform.is_cpu() and envs.VLLM_CPU_OMP_THREADS_BIND != "nobind"


def without_worker_binding(env: dict[str, str]) -> dict[str, str]:
    """``env`` less the binding vLLM gave the worker it came from, when vLLM
    binds threads here (with ``nobind`` these variables are the user's)."""
    if not binds_threads():
        return dict(env)
    return {k: v for k, v in env.items() if k not in WORKER_BINDING_ENV}


class FFNThreadBinding:
    """vLLM's binding computed for ``num_processes`` local CPU workers (the
    FFN side's), applied one process at a time by :meth:`around_start`."""

    def __init__(self, num_processes: int) -> None:
        # The fields of a VllmConfig that OMPProcessManager reads, for a local
        # world of the FFN processes: no data-parallel slicing of the core
        # lists (the FFN side is no DP rank), no KV transfer.
        world = SimpleNamespace(
            parallel_config=SimpleNamespace(
                local_world_size=num_processes,
                data_parallel_rank_local=None,
                _api_process_count=1,
            ),
            kv_transfer_config=None,
        )
        try:
            self._manager = OMPProcessManager(world)  # type: ignore[arg-type]
        except AssertionError as e:
            raise ValueError(
                f"AFD: cannot bind the threads of the FFN side's {num_processes} processes "
                f"(num_ffn_ranks x ffn_tensor_parallel_size) as "
                f"VLLM_CPU_OMP_THREADS_BIND={envs.VLLM_CPU_OMP_THREADS_BIND!r} says: {e}. "
                "Give the FFN side one core list per process (with spawn_ffn it reads "
                "the attention side's setting; start it with `vllm afd-ffn` to give it "
                "its own), or set VLLM_CPU_OMP_THREADS_BIND=nobind."
            ) from e

    @contextlib.contextmanager
    def around_start(self, index: int) -> Iterator[None]:
        """OpenMP's environment for FFN process ``index`` (``f * T + t``)
        while it starts."""
        with self._manager.configure_omp_envs(rank=index, local_rank=index):
            yield


def describe_binding() -> str:
    """This process's OpenMP threads and the cores it may run on, for its
    start-up log (OpenMP has bound the process's first thread by then)."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return f"{torch.get_num_threads()} OpenMP threads on cores {cores}"
