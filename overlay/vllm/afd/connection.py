# SPDX-License-Identifier: Apache-2.0
"""Bringing up this process's AFD endpoint: the sequence above the transfer layer.

The attention side connects while its worker initialises the distributed
environment, before the model loads, so a missing FFN rank fails fast; with
``spawn_ffn``, attention rank 0 first starts the local FFN ranks. Of a
tensor-parallel attention rank, only TP rank 0 connects. The FFN side
connects once its FFN weights are loaded (``connect_ffn_endpoint``). The
transfer layer below knows nothing of models: this module tells it how wide
the rows it carries are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.distributed.afd_transfer.afd_transfer_state import get_afd_endpoint, set_afd_endpoint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.accounting import StepObserver
    from vllm.distributed.afd_transfer.afd_connector.base import ExchangeShape
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint
    from vllm.distributed.afd_transfer.payload import TokenLayout


def _exchange_shape(vllm_config: VllmConfig) -> ExchangeShape:
    # Imported here: the model registry pulls in vLLM's model code, which the
    # worker modules that call this must not import at their own import time.
    from vllm.afd.models.registry import ffn_exchange_shape

    return ffn_exchange_shape(vllm_config)


def ensure_afd_connector_initialized(vllm_config: VllmConfig) -> None:
    """The attention worker's hook: create and connect this attention rank's
    endpoint, once (its data-parallel rank is its attention rank, unless the
    config names one: ``attention_rank``)."""
    afd = vllm_config.afd_config
    if afd is None or get_afd_endpoint() is not None:
        return
    assert afd.role == "attention", "an FFN process connects with connect_ffn_endpoint"
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 0:
        # The other TP ranks of a tensor-parallel attention rank hold the
        # same hidden states; only TP rank 0 talks to the FFN rank
        # (vllm/afd/models/remote_ffn.py).
        return
    from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint

    # A data-parallel rank of the deployment, or an attention rank of its own.
    rank = afd.attention_rank
    if rank is None:
        rank = vllm_config.parallel_config.data_parallel_rank
    shape = _exchange_shape(vllm_config)
    if afd.spawn_ffn and rank == 0:
        from vllm.afd.attention.launcher import SpawnedFFN

        spawned = SpawnedFFN(vllm_config)
        endpoint = AttentionEndpoint(
            vllm_config,
            rank,
            shape,
            on_close=[spawned.wait],
            start_replacement=spawned.restart if afd.failover_timeout_s else None,
        )
        endpoint.connect(still_waiting=spawned.check_alive)
    else:
        endpoint = AttentionEndpoint(vllm_config, rank, shape)
        endpoint.connect()
    set_afd_endpoint(endpoint)


def connect_ffn_endpoint(
    vllm_config: VllmConfig,
    ffn_rank: int,
    layouts_for_standby: Callable[[], list[TokenLayout] | None],
    step_observers: Iterable[StepObserver] = (),
    before_connect: Callable[[FFNEndpoint], None] | None = None,
) -> FFNEndpoint:
    """Create and connect the endpoint of FFN rank ``ffn_rank`` (its group's
    leader); a standby first prepares with it (``before_connect``), before
    it waits for its port. ``FFNEndpoint`` says what the others are."""
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint

    endpoint = FFNEndpoint(
        vllm_config,
        ffn_rank,
        _exchange_shape(vllm_config),
        layouts_for_standby=layouts_for_standby,
        step_observers=step_observers,
    )
    if before_connect is not None:
        before_connect(endpoint)
    endpoint.connect()
    set_afd_endpoint(endpoint)
    if vllm_config.afd_config.mps != "off":
        check_peers_sharing_the_gpu(endpoint)
    return endpoint


def check_peers_sharing_the_gpu(endpoint: FFNEndpoint) -> None:
    """FFN side, on GPUs whose data plane reports its peers' GPUs (ipc): MPS
    for the processes of this FFN rank that share one."""
    from vllm.afd.platform.mps import check_gpu_sharing, describe_shared_gpus
    from vllm.distributed.afd_transfer.afd_connector.gpus import device_uuid

    peer_gpus = {rank: facts["gpu"] for rank, facts in endpoint.peer_devices.items()
                 if "gpu" in facts}  # fmt: skip
    if not peer_gpus:  # CPU, or a data plane that does not report them
        return
    sharing = describe_shared_gpus(endpoint.rank, device_uuid(), peer_gpus)
    if sharing is not None:
        import torch

        check_gpu_sharing(sharing, torch.cuda.current_device())
