# SPDX-License-Identifier: Apache-2.0
"""Attention-FFN Disaggregation transfer: the data planes (``afd_connector``),
the control plane (``control``), the role endpoints that own both
(``endpoint``), failover, accounting, handshake and the data-plane custom
ops. Shaped like ``vllm.distributed.kv_transfer``. Nothing here imports the
AFD runtime or model code above it (``vllm.afd``)."""

from vllm.distributed.afd_transfer.afd_transfer_state import (
    afd_step,
    ensure_afd_connector_shutdown,
    get_afd_endpoint,
    get_attention_endpoint,
    get_ffn_endpoint,
)

__all__ = [
    "afd_step",
    "ensure_afd_connector_shutdown",
    "get_afd_endpoint",
    "get_attention_endpoint",
    "get_ffn_endpoint",
]
