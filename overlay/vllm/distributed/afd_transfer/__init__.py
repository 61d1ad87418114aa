# SPDX-License-Identifier: Apache-2.0
"""Attention-FFN Disaggregation transfer: control plane, handshake, connectors
and the data-plane custom ops. Shaped like ``vllm.distributed.kv_transfer``.
Nothing here imports the AFD runtime or model code above it (``vllm.afd``)."""

from vllm.distributed.afd_transfer.afd_transfer_state import (
    afd_step,
    ensure_afd_connector_shutdown,
    get_afd_connector,
)

__all__ = ["afd_step", "ensure_afd_connector_shutdown", "get_afd_connector"]
