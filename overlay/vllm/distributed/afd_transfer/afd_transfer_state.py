# SPDX-License-Identifier: Apache-2.0
"""The process's AFD connector, created once per rank.

The attention side creates it while its worker initialises the distributed
environment (before the model loads, so a missing FFN rank fails fast); the
FFN side creates it once its FFN weights are loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.afd_transfer.afd_connector.factory import AFDConnectorFactory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase

_AFD_CONNECTOR: AFDConnectorBase | None = None


def get_afd_connector() -> AFDConnectorBase | None:
    """The connector of this process, or None when AFD is off."""
    return _AFD_CONNECTOR


def ensure_afd_connector_initialized(vllm_config: VllmConfig, rank: int | None = None) -> None:
    """Create and connect this process's connector, once.

    ``rank`` defaults to the data-parallel rank on the attention side; the FFN
    side passes its FFN rank. With ``spawn_ffn``, attention rank 0 first
    starts the local FFN ranks.
    """
    global _AFD_CONNECTOR
    afd = vllm_config.afd_config
    if afd is None or _AFD_CONNECTOR is not None:
        return
    if rank is None:
        assert afd.role == "attention", "the FFN side must pass its FFN rank"
        rank = vllm_config.parallel_config.data_parallel_rank
    connector = AFDConnectorFactory.create_connector(vllm_config, rank)
    if afd.role == "attention" and afd.spawn_ffn and rank == 0:
        from vllm.afd.launcher import spawn_local_ffn_ranks

        ffn_process = spawn_local_ffn_ranks(vllm_config)
        connector.on_close(ffn_process.wait)
        connector.connect(still_waiting=ffn_process.check_alive)
    else:
        connector.connect()
    _AFD_CONNECTOR = connector


def ensure_afd_connector_shutdown() -> None:
    global _AFD_CONNECTOR
    if _AFD_CONNECTOR is not None:
        _AFD_CONNECTOR.close()
        _AFD_CONNECTOR = None
