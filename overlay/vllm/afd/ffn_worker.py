# SPDX-License-Identifier: Apache-2.0
"""One FFN rank: device, a one-rank distributed environment for vLLM's
parallel layers, the FFN runner, and the connector to its attention peers."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from vllm.afd.connection import ensure_afd_connector_initialized
from vllm.afd.ffn_runner import FFNModelRunner
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.distributed.afd_transfer import (
    ensure_afd_connector_shutdown,
    get_afd_connector,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.worker.workspace import init_workspace_manager

try:  # vLLM >= 0.29 moved it
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance
except ImportError:
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

logger = init_logger(__name__)


def ffn_device_index(vllm_config: VllmConfig, ffn_rank: int) -> int:
    """The visible GPU of an FFN rank: the attention ranks take the first A
    GPUs of a node (one each, as data-parallel ranks do), the FFN ranks the
    ones after them, wrapping around. On a single GPU both roles share it,
    which the ipc connector supports; set CUDA_VISIBLE_DEVICES to place the
    FFN ranks otherwise."""
    first = vllm_config.afd_config.num_attention_ranks
    return (first + ffn_rank) % torch.cuda.device_count()


class FFNWorker:
    def __init__(self, vllm_config: VllmConfig, ffn_rank: int) -> None:
        self.vllm_config = vllm_config
        self.ffn_rank = ffn_rank
        self.device = torch.device(current_platform.device_type)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", ffn_device_index(vllm_config, ffn_rank))
            torch.cuda.set_device(self.device)
        self.runner = FFNModelRunner(vllm_config, self.device)

    def init_device(self) -> None:
        # As vLLM's GPU worker does, before any kernel runs: with
        # VLLM_BATCH_INVARIANT=1 the attention side's kernels are batch-
        # invariant, and the FFN's must be too, or its output for a token
        # would depend on the batch (or micro-batch) it came in.
        init_batch_invariance()
        # The FFN's linear layers ask vLLM for their tensor-parallel group: one
        # rank. A file store keeps that group off the network (a TCP store would
        # listen on every interface).
        store = Path(tempfile.mkdtemp(prefix="afd-ffn-")) / "store"
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{store}",
                local_rank=self.device.index or 0,
                backend=current_platform.dist_backend,
            )
            ensure_model_parallel_initialized(1, 1)
        if self.device.type == "cuda":
            # As vLLM's GPU worker does: FusedMoE's GPU kernels take scratch
            # here. One workspace: the FFN rank runs the stages one after another.
            init_workspace_manager(self.device)
        elif self.device.type == "cpu":
            # As vLLM's CPU model runner does: the model loader asks
            # torch.accelerator to free its cache (from vLLM 0.32), which a
            # CPU-only torch refuses.
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

            _set_torch_accelerator_to_noop()

    def load_model(self) -> None:
        self.runner.load_model()

    def connect(self) -> None:
        ensure_afd_connector_initialized(self.vllm_config, rank=self.ffn_rank)

    def serve(self) -> None:
        connector = get_afd_connector()
        assert connector is not None
        try:
            self.runner.serve(connector)
        except Exception as e:
            # Name the attention rank that was lost and stop the others with it.
            raise connector.stop_serving(e) from e
        finally:
            ensure_afd_connector_shutdown()


def run_ffn_rank(vllm_config: VllmConfig, ffn_rank: int) -> None:
    """Everything one FFN rank does, from start to clean exit."""
    worker = FFNWorker(vllm_config, ffn_rank)
    worker.init_device()
    worker.load_model()
    worker.connect()
    worker.serve()
