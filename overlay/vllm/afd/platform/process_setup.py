# SPDX-License-Identifier: Apache-2.0
"""What a process of an AFD deployment sets up for itself and for the
processes it starts: the one place where AFD writes the process environment
(config verification only reads).

``set_up_afd_process`` runs once in each process that builds a deployment's
config, right after building it, in ``EngineArgs.create_engine_config``
(patch 0002): every front end builds its engine config there first, ``LLM``,
``vllm serve`` (``--headless`` too) and ``vllm bench`` on the attention side,
``vllm afd-ffn`` (``ffn/server.py``) on the FFN side, the one that
``spawn_ffn`` starts included. That process has started no other yet.

Why there, and not in each engine, worker or FFN process as it starts: the
settings count when those processes start, so they must already be in the
environment they inherit.

- ``OMP_WAIT_POLICY``: OpenMP reads it once, when it loads with torch at a
  process's start. An engine core, a worker or an FFN group process that
  sets it itself is too late; so is the process that builds the config,
  which keeps the policy it started with (a hand-started one-process FFN
  rank takes it from its shell, docs/deploy.md).
- ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, and the private MPS daemon's
  ``CUDA_MPS_PIPE_DIRECTORY``: the CUDA driver reads them when a process
  creates its context. The process that builds the config creates none
  before the workers it starts create theirs, and the one that runs its
  worker in-process (no engine multiprocessing) creates it later still.
- ``mps: start``: the daemon's supervisor stops it when the process that
  started it ends, so that must be the deployment's first process, which
  outlives its engines and workers.

CPU thread binding (``OMP_NUM_THREADS``, ``OMP_PLACES``, ...) differs from
one started process to the next, so it is not set here but by the starter
around each start, as vLLM binds its CPU workers: the FFN server around each
FFN process (``cpu_binding.FFNThreadBinding``); the FFN side that
``spawn_ffn`` starts gets the attention worker's environment without that
worker's binding (``attention/launcher.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.afd.platform.mps import ensure_private_daemon, set_active_thread_percentage

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def set_up_afd_process(vllm_config: VllmConfig) -> None:
    """Set this process's environment for the AFD role of ``vllm_config``
    (verified), before it starts any other process or creates a CUDA
    context: the private MPS daemon (``mps: start``), the role's share of
    the GPU's SMs under MPS, and OpenMP's passive wait on CPU."""
    afd = vllm_config.afd_config
    device = vllm_config.device_config
    if afd is None or device is None:
        return
    if afd.mps == "start":
        ensure_private_daemon()
    if afd.mps_active_thread_percentage:
        set_active_thread_percentage(afd.mps_active_thread_percentage, afd.role)
    if device.device_type == "cpu":
        # The roles take turns on the same cores: OpenMP threads that spin after
        # each parallel region hold the core the peer process needs next (tiny
        # model, 2 cores: 57 -> 17 ms per token). It reaches the engine and FFN
        # processes started after this one, as the CPU platform's own settings do.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
