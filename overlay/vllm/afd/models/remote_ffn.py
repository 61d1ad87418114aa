# SPDX-License-Identifier: Apache-2.0
"""The attention side's stand-in for a decoder layer's FFN.

Upstream decoder layers build their FFN as ``self.mlp = remote_ffn(prefix) or
<FFN class>(...)``: with AFD on the attention role the FFN class is never
built, and the layer sends its normed hidden states to the FFN rank instead.
``RemoteFFN`` is a ``PPMissingLayer``, the marker vLLM's weight loaders
already skip, so the checkpoint's FFN weights are passed over unchanged.
"""

from __future__ import annotations

import torch
import vllm.distributed.afd_transfer.ops  # noqa: F401  (registers the ops)
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index


class RemoteFFN(PPMissingLayer):
    """Runs one decoder layer's FFN on the FFN rank: send, then receive."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        handle = torch.ops.vllm.afd_send(hidden_states, self.layer_idx)
        return torch.ops.vllm.afd_recv(handle, hidden_states, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


def remote_ffn(layer_prefix: str) -> RemoteFFN | None:
    """A ``RemoteFFN`` for the decoder layer at ``layer_prefix`` when this
    process is an AFD attention rank, otherwise None (build the FFN here)."""
    afd = get_current_vllm_config().afd_config
    if afd is None or afd.role != "attention":
        return None
    return RemoteFFN(extract_layer_index(layer_prefix))
