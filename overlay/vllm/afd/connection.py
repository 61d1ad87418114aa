# SPDX-License-Identifier: Apache-2.0
"""Bringing up this process's AFD connector: the sequence above the transfer layer.

The attention side connects while its worker initialises the distributed
environment, before the model loads, so a missing FFN rank fails fast; with
``spawn_ffn``, attention rank 0 first starts the local FFN ranks. Of a
tensor-parallel attention rank, only TP rank 0 connects. The FFN
side connects once its FFN weights are loaded. The transfer layer below
knows nothing of models: this module tells it how wide the rows it carries are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.distributed.afd_transfer.afd_connector.factory import AFDConnectorFactory
from vllm.distributed.afd_transfer.afd_transfer_state import get_afd_connector, set_afd_connector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase


def ensure_afd_connector_initialized(
    vllm_config: VllmConfig,
    rank: int | None = None,
    before_connect: Callable[[AFDConnectorBase], None] | None = None,
) -> None:
    """Create and connect this process's connector, once.

    ``rank`` defaults to the data-parallel rank on the attention side; the FFN
    side passes its FFN rank, and a standby what it does with the connector
    before it waits for its port (``before_connect``).
    """
    afd = vllm_config.afd_config
    if afd is None or get_afd_connector() is not None:
        return
    if rank is None:
        assert afd.role == "attention", "the FFN side must pass its FFN rank"
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            # The other TP ranks of a tensor-parallel attention rank hold the
            # same hidden states; only TP rank 0 talks to the FFN rank
            # (vllm/afd/models/remote_ffn.py).
            return
        rank = vllm_config.parallel_config.data_parallel_rank
    # Imported here: the model registry pulls in vLLM's model code, which the
    # worker modules that call this must not import at their own import time.
    from vllm.afd.models.registry import ffn_input_width

    connector = AFDConnectorFactory.create_connector(
        vllm_config, rank, input_width=ffn_input_width(vllm_config)
    )
    if afd.role == "attention" and afd.spawn_ffn and rank == 0:
        from vllm.afd.attention.launcher import SpawnedFFN

        spawned = SpawnedFFN(vllm_config)
        connector.on_close(spawned.wait)
        if afd.failover_timeout_s:
            connector.start_replacement = spawned.restart
        connector.connect(still_waiting=spawned.check_alive)
    else:
        if before_connect is not None:
            before_connect(connector)
        connector.connect()
    set_afd_connector(connector)
    if afd.role == "ffn" and afd.mps != "off":
        check_peers_sharing_the_gpu(connector)


def check_peers_sharing_the_gpu(connector) -> None:
    """FFN side, on GPUs whose connector reports its peers' GPUs (ipc): MPS
    for the processes of this FFN rank that share one."""
    from vllm.afd.platform.mps import check_gpu_sharing, describe_shared_gpus
    from vllm.distributed.afd_transfer.afd_connector.gpus import device_uuid

    peer_gpus = {rank: facts["gpu"] for rank, facts in connector.peer_devices.items()
                 if "gpu" in facts}  # fmt: skip
    if not peer_gpus:  # CPU, or a connector that does not report them
        return
    sharing = describe_shared_gpus(connector.rank, device_uuid(), peer_gpus)
    if sharing is not None:
        import torch

        check_gpu_sharing(sharing, torch.cuda.current_device())
