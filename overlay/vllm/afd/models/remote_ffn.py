# SPDX-License-Identifier: Apache-2.0
"""The attention side's stand-in for a decoder layer's FFN.

Upstream decoder layers build their FFN as ``self.mlp = remote_ffn(prefix) or
<FFN class>(...)``: with AFD on the attention role the FFN class is never
built, and the layer sends its normed hidden states to the FFN rank instead.
``RemoteFFN`` is a ``PPMissingLayer``, the marker vLLM's weight loaders
already skip, so the checkpoint's FFN weights are passed over unchanged.

With ``compute_gate_on_attention`` a MoE layer gets ``RemoteMoE`` instead: it
keeps the block's router gate here (the only FFN weights the attention side
loads), and sends the router logits beside the hidden states, packed in one
tensor.

A model that routes by token id (DeepSeek-V4) calls its FFN with the
forward's token ids too; both stand-ins then send them in the rows' last
columns (``spec.token_ids_on_wire``).

MiniMax-M3's layer asks ``is_remote_ffn`` whether its FFN's all-reduce is
left to the next norm: a stand-in's is not.

A LongCat-Flash layer gets ``remote_shortcut_moe`` instead: two exchanges
for its two MLPs, and a stand-in for its shortcut MoE (``shortcut_moe``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import vllm.distributed.afd_transfer.ops  # noqa: F401  (registers the ops)
from torch import nn
from vllm.afd.models.shortcut_moe import EXCHANGES_PER_LAYER
from vllm.afd.models.spec import token_ids_on_wire
from vllm.config import get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index


class _FFNRankLink:
    """This attention worker's part in one layer's exchange with the FFN rank.

    With tensor-parallel attention the normed hidden states are the same on
    every TP rank. Only TP rank 0 sends them (each token crosses to the FFN
    rank once, and the FFN rank sees one peer per attention rank, as without
    TP); the FFN output reaches the other TP ranks through vLLM's TP
    all-reduce, to which they add zeros. That collective runs under torch.compile
    and CUDA graph capture on every platform, and x + 0 is exact; it moves up
    to twice the bytes of a broadcast, over the TP group's own link. The
    rows to send are built only on TP rank 0 (``pack``), so the other TP
    ranks skip the router gate and the padding.
    """

    def __init__(self) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.sends = get_tensor_model_parallel_rank() == 0

    def exchange(
        self,
        pack: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None,
        layer_idx: int,
    ) -> torch.Tensor:
        if self.sends:
            handle = torch.ops.vllm.afd_send(pack(hidden_states, input_ids), layer_idx)
            out = torch.ops.vllm.afd_recv(handle, hidden_states, layer_idx)
        else:
            out = torch.zeros_like(hidden_states)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class RemoteFFN(PPMissingLayer):
    """Runs one decoder layer's FFN on the FFN rank: send, then receive.

    ``num_router_logits`` > 0 (gate on attention, a dense layer of a MoE
    model: the logits' columns on the wire) pads the rows with zeros, so
    every layer sends rows of one width. ``input_ids``, given where the
    model routes by token id, follow."""

    def __init__(self, layer_idx: int, num_router_logits: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_router_logits = num_router_logits
        self.link = _FFNRankLink()

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.link.exchange(self._pack, hidden_states, input_ids, self.layer_idx)

    def _pack(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        columns = [hidden_states]
        if self.num_router_logits:
            columns.append(hidden_states.new_zeros(hidden_states.shape[0], self.num_router_logits))
        if input_ids is not None:
            columns.append(token_ids_on_wire(input_ids, hidden_states.dtype))
        return torch.cat(columns, dim=-1) if len(columns) > 1 else hidden_states

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


class RemoteMoE(nn.Module):
    """A MoE layer whose router gate runs here and whose experts run on the
    FFN rank: sends ``[hidden_states | router_logits]``. The gate keeps the
    block's name for it (``gate_name``); the block's other parts
    (``remote_parts``: experts, shared experts) are ``PPMissingLayer``
    placeholders, so the upstream loaders skip their weights."""

    def __init__(
        self,
        layer_idx: int,
        gate: nn.Module,
        gate_name: str,
        remote_parts: tuple[str, ...],
        router_logits: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        logits_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_name = gate_name
        self.add_module(gate_name, gate)
        self.router_logits = router_logits
        self.logits_dtype = logits_dtype
        self.link = _FFNRankLink()
        for name in remote_parts:
            self.add_module(name, PPMissingLayer())

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.link.exchange(self._pack, hidden_states, input_ids, self.layer_idx)

    def _pack(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        router_logits = self.router_logits(getattr(self, self.gate_name), hidden_states)
        # The logits' bytes, viewed as the hidden states' dtype: a float32
        # router's (GLM-4.5's) take two bf16 columns each and arrive exact.
        wire = router_logits.to(self.logits_dtype).contiguous().view(hidden_states.dtype)
        columns = [hidden_states, wire]
        if input_ids is not None:
            columns.append(token_ids_on_wire(input_ids, hidden_states.dtype))
        return torch.cat(columns, dim=-1)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


def remote_ffn(layer_prefix: str) -> nn.Module | None:
    """The remote stand-in for the FFN of the decoder layer at
    ``layer_prefix`` when this process is an AFD attention rank, otherwise
    None (build the FFN here)."""
    vllm_config = get_current_vllm_config()
    afd = vllm_config.afd_config
    if afd is None or afd.role != "attention":
        return None
    layer_idx = extract_layer_index(layer_prefix)
    if not afd.compute_gate_on_attention:
        return RemoteFFN(layer_idx)
    from vllm.afd.models.registry import get_afd_model_spec

    model = vllm_config.model_config
    routing = get_afd_model_spec(model.architecture).routing
    config = model.hf_text_config
    if routing.is_moe_layer(config, layer_idx):
        gate = routing.build_gate(vllm_config, f"{layer_prefix}.mlp")
        return RemoteMoE(
            layer_idx,
            gate,
            routing.gate_name,
            routing.remote_parts,
            routing.router_logits,
            routing.wire_dtype(config, model.dtype),
        )
    return RemoteFFN(layer_idx, num_router_logits=routing.router_logit_columns(config, model.dtype))


def is_remote_ffn(ffn: nn.Module) -> bool:
    """Whether a decoder layer's FFN is ``remote_ffn``'s stand-in. A model
    that fuses its FFN's all-reduce into the next norm (MiniMax-M3's
    ``ffn_all_reduce_deferred``) asks this: a stand-in's output arrives
    already reduced over the attention TP group (``_FFNRankLink``)."""
    return isinstance(ffn, (RemoteFFN, RemoteMoE))


class FoldedShortcut(PPMissingLayer):
    """The attention side's stand-in for LongCat-Flash's shortcut MoE block:
    zeros, as its output comes back inside the layer's second exchange
    (``shortcut_moe``). A ``PPMissingLayer``, so the upstream loader skips
    the block's weights."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


class RemoteShortcutMoE(NamedTuple):
    """A LongCat-Flash decoder layer's ``mlps`` and ``mlp`` on the attention side."""

    mlps: nn.ModuleList
    shortcut: nn.Module


def remote_shortcut_moe(layer_prefix: str) -> RemoteShortcutMoE | None:
    """The attention side's stand-ins for the FFN parts of the LongCat-Flash
    decoder layer at ``layer_prefix`` when this process is an AFD attention
    rank, otherwise None (build them here)."""
    afd = get_current_vllm_config().afd_config
    if afd is None or afd.role != "attention":
        return None
    first = EXCHANGES_PER_LAYER * extract_layer_index(layer_prefix)
    mlps = nn.ModuleList(RemoteFFN(first + part) for part in range(EXCHANGES_PER_LAYER))
    return RemoteShortcutMoE(mlps, FoldedShortcut())
