# SPDX-License-Identifier: Apache-2.0
"""One process of an FFN rank: device, the distributed environment of vLLM's
parallel layers (the FFN rank's group, one process unless
``ffn_tensor_parallel_size`` > 1), the FFN runner, and, on the group's
leader, the endpoint that serves its attention peers."""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from vllm.afd.connection import connect_ffn_endpoint
from vllm.afd.ffn.group import FFNGroup
from vllm.afd.ffn.http_server import FFNHttpServer, FFNRankState
from vllm.afd.ffn.runner import FFNModelRunner
from vllm.afd.models.registry import ffn_input_width
from vllm.afd.platform.cpu_binding import describe_binding
from vllm.afd.platform.mps import check_gpu_sharing, describe_mps
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.afd import AFDConfig
from vllm.distributed import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.distributed.afd_transfer import ensure_afd_connector_shutdown, get_ffn_endpoint
from vllm.distributed.parallel_state import set_custom_all_reduce
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.worker.workspace import init_workspace_manager

try:  # vLLM >= 0.29 moved it
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance
except ImportError:
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint

logger = init_logger(__name__)


CPU_ACCELERATOR_NOOP = "vllm.v1.worker.cpu_model_runner"
"""Up to vLLM 0.33: the module whose ``_set_torch_accelerator_to_noop`` the
CPU model runner (V1) calls before it builds anything."""
CPU_TORCH_SHIM = "vllm.v1.worker.cpu.shm"
"""From vLLM 0.34 (V1 and that module gone): the module the CPU worker
imports first, which turns torch's accelerator calls into no-ops (and stubs
CUDA streams and events) as it is imported."""


def set_cpu_accelerator_to_noop() -> str:
    """Turn ``torch.accelerator``'s synchronize and empty_cache into no-ops
    on a CPU-only process, the way this vLLM release's CPU worker does;
    returns the module that did it."""
    if importlib.util.find_spec(CPU_ACCELERATOR_NOOP) is not None:
        importlib.import_module(CPU_ACCELERATOR_NOOP)._set_torch_accelerator_to_noop()
        return CPU_ACCELERATOR_NOOP
    importlib.import_module(CPU_TORCH_SHIM)
    return CPU_TORCH_SHIM


def ffn_device_index(afd: AFDConfig, ffn_rank: int, group_rank: int, num_devices: int) -> int:
    """The visible GPU (of ``num_devices``) of one process of an FFN rank:
    from ``ffn_first_device`` on, by default the GPU after one per attention
    rank, wrapping around. On a single GPU both roles share it, which the
    ipc connector supports."""
    first = afd.ffn_first_device
    if first is None:
        first = afd.num_attention_ranks
    slot = first + ffn_rank * afd.ffn_tensor_parallel_size + group_rank
    return slot % num_devices


def check_group_fits_the_gpus(group_size: int, num_devices: int) -> None:
    """An FFN rank's processes need a GPU each: NCCL, which carries the
    group's collectives, refuses two processes of one group on one GPU
    (unless each is told it is a host of its own, ``NCCL_HOSTID``, as a
    test placement does)."""
    if group_size > num_devices and "NCCL_HOSTID" not in os.environ:
        raise ValueError(
            f"AFD: an FFN rank group of {group_size} processes "
            f"(ffn_tensor_parallel_size={group_size}) needs a GPU for each, but the FFN "
            f"side sees {num_devices}; NCCL cannot run two processes of one group on one "
            "GPU. Make more GPUs visible to the FFN side (CUDA_VISIBLE_DEVICES) or lower "
            "ffn_tensor_parallel_size on both sides"
        )


class FFNWorker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        ffn_rank: int,
        group_rank: int = 0,
        group_store: Path | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.ffn_rank = ffn_rank
        # A file store keeps the group's rendezvous off the network (a TCP
        # store would listen on every interface). The processes of one group
        # share it (a path that does not exist yet); a one-process rank makes
        # its own, removed with the worker or at the process's exit.
        if group_store is None:
            self._own_store_dir = tempfile.TemporaryDirectory(prefix="afd-ffn-")
            group_store = Path(self._own_store_dir.name) / "store"
        self.group_store = group_store
        self.device = torch.device(current_platform.device_type)
        if self.device.type == "cuda":
            afd, num_devices = vllm_config.afd_config, torch.cuda.device_count()
            check_group_fits_the_gpus(afd.ffn_tensor_parallel_size, num_devices)
            index = ffn_device_index(afd, ffn_rank, group_rank, num_devices)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
            logger.info(
                "AFD FFN rank %d, group rank %d: GPU %d, %s",
                ffn_rank,
                group_rank,
                index,
                describe_mps(index),
            )
            if afd.mps != "off" and group_rank == 0 and afd.ffn_tensor_parallel_size > num_devices:
                check_gpu_sharing(
                    f"the {afd.ffn_tensor_parallel_size} processes of FFN rank {ffn_rank} "
                    f"share {num_devices} GPU(s)",
                    index,
                )
        model = vllm_config.model_config
        self.group = FFNGroup(
            vllm_config.afd_config.ffn_tensor_parallel_size,
            group_rank,
            width=ffn_input_width(vllm_config),
            dtype=model.dtype,
            device=self.device,
        )
        self.runner = FFNModelRunner(vllm_config, self.device, self.group)
        self.state = FFNRankState(ffn_rank)
        self.state.runner = self.runner
        self.endpoints: FFNHttpServer | None = None
        if not vllm_config.afd_config.standby:
            # Up before the weights load: a probe sees the rank is alive and
            # starting. A standby's port is its FFN rank's until it takes over.
            self._start_endpoints()

    def _start_endpoints(self) -> None:
        afd = self.vllm_config.afd_config
        if afd.metrics_port is None or not self.group.is_leader:
            return
        self.endpoints = FFNHttpServer(afd.host, afd.metrics_port + self.ffn_rank, self.state)
        logger.info(
            "AFD FFN rank %d: /health and /metrics on http://%s",
            self.ffn_rank,
            self.endpoints.address,
        )

    def init_device(self) -> None:
        # As vLLM's GPU worker does, before any kernel runs: with
        # VLLM_BATCH_INVARIANT=1 the attention side's kernels are batch-
        # invariant, and the FFN's must be too, or its output for a token
        # would depend on the batch (or micro-batch) it came in.
        init_batch_invariance()
        if self.device.type == "cpu":
            # vLLM's CPU all-reduce names its shared memory by VLLM_DIST_IDENT,
            # which a spawned FFN rank inherits from the attention worker that
            # holds that name for its own TP group. As vLLM's CPU worker does,
            # name it after this group's rendezvous.
            store = self.group_store
            os.environ["VLLM_DIST_IDENT"] = f"afd-{store.parent.name}-{store.name}"
            # vLLM's CPU MoE and linear kernels use AMX tiles where the CPU has
            # them, which Linux grants a process only once it asks. In a stock
            # engine oneDNN asks, in the first linear layer it runs; an FFN
            # rank whose first kernel is vLLM's AMX MoE (the router gate on
            # the attention side) would die of SIGILL, so it asks first.
            if torch.cpu._is_amx_tile_supported():
                torch._C._cpu._init_amx()
            logger.info(
                "AFD FFN rank %d, group rank %d: %s",
                self.ffn_rank,
                self.group.rank,
                describe_binding(),
            )
        # The FFN's layers ask vLLM for their tensor-parallel group, and split
        # themselves over it (experts too, with expert parallelism). As vLLM's
        # GPU worker does, the group's all-reduce honours
        # --disable-custom-all-reduce.
        set_custom_all_reduce(not self.vllm_config.parallel_config.disable_custom_all_reduce)
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(
                world_size=self.group.size,
                rank=self.group.rank,
                distributed_init_method=f"file://{self.group_store}",
                local_rank=self.device.index or 0,
                backend=current_platform.dist_backend,
            )
            ensure_model_parallel_initialized(self.group.size, 1)
        if self.device.type == "cuda":
            # As vLLM's GPU worker does: FusedMoE's GPU kernels take scratch
            # here. One workspace: the FFN rank runs the stages one after another.
            init_workspace_manager(self.device)
        elif self.device.type == "cpu":
            # As vLLM's CPU model runner does: the model loader asks
            # torch.accelerator to free its cache (from vLLM 0.32), which a
            # CPU-only torch refuses.
            set_cpu_accelerator_to_noop()

    def load_model(self) -> None:
        self.runner.load_model()
        self.state.phase = "waiting for attention peers"

    def connect(self) -> None:
        if not self.group.is_leader:
            return
        standby = self.vllm_config.afd_config.standby
        self.state.endpoint = connect_ffn_endpoint(
            self.vllm_config,
            self.ffn_rank,
            layouts_for_standby=self.runner.graphs.layouts_for_standby,
            step_observers=[self._observe_step],
            before_connect=self._prepare_takeover if standby else None,
        )
        if standby:
            self._start_endpoints()
        self.state.phase = "serving"

    def _observe_step(self, compute_ms: float, exchange_ms: float) -> None:
        # A standby's HTTP server starts only once it has taken over.
        if self.endpoints is not None:
            self.endpoints.observe_step(compute_ms, exchange_ms)

    def _prepare_takeover(self, endpoint: FFNEndpoint) -> None:
        """A standby, before it waits for its FFN rank's port: checked
        against that rank and, where its graphs hold the peers' memory,
        with those graphs captured."""
        layouts = endpoint.prepare_standby(capture_graphs=self.runner.graphs.enabled)
        if layouts:
            self.runner.rehearse(endpoint, layouts)

    def serve(self) -> None:
        if not self.group.is_leader:
            # Ends with the leader's shutdown step; if the leader dies instead,
            # the FFN server stops this process.
            self.runner.serve(None)
            return
        endpoint = get_ffn_endpoint()
        assert endpoint is not None
        try:
            self.runner.serve(endpoint)
        except KeyboardInterrupt:
            # Ctrl-C on a hand-started FFN rank: the peers are told why it stops.
            endpoint.stop_serving("interrupted (SIGINT)")
            raise
        except Exception as e:
            # Name the attention rank that was lost and stop the others with it.
            raise endpoint.stop_serving(e) from e
        finally:
            self.state.phase = "shut down"
            ensure_afd_connector_shutdown()


def run_ffn_rank(
    vllm_config: VllmConfig, ffn_rank: int, group_rank: int = 0, group_store: Path | None = None
) -> None:
    """Everything one process of an FFN rank does, from start to clean exit."""
    try:
        worker = FFNWorker(vllm_config, ffn_rank, group_rank, group_store)
        worker.init_device()
        worker.load_model()
        worker.connect()
        worker.serve()
    except KeyboardInterrupt:
        # The server passes a terminal's Ctrl-C on too: the second is no news.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logger.info("AFD FFN rank %d, group rank %d: interrupted, stopped", ffn_rank, group_rank)
        raise SystemExit(130) from None
