# SPDX-License-Identifier: Apache-2.0
"""The FFN role's model: the FFN of every decoder layer and nothing else.

Parameters keep the checkpoint's names (``model.layers.N.mlp.*``), so vLLM's
own loaders (safetensors, dummy, quantized) fill them; every other tensor of
the checkpoint (embeddings, attention, norms, head, multi-token-prediction
layers) is skipped, unread with safetensors (``weight_roles.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.afd.models.registry import ffn_exchange_shape, get_afd_model_spec
from vllm.afd.models.spec import token_id_columns, token_ids_from_wire
from vllm.afd.models.upstream_loader import class_loader_use
from vllm.afd.models.weight_roles import is_ffn_weight
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import AutoWeightsLoader


class _FFNLayer(nn.Module):
    def __init__(self, name: str, ffn: nn.Module) -> None:
        super().__init__()
        self.add_module(name, ffn)  # under the decoder layer's name for it
        self.ffn_name = name

    @property
    def ffn_module(self) -> nn.Module:
        return getattr(self, self.ffn_name)


class _FFNLayers(nn.Module):
    def __init__(self, layers: list[_FFNLayer], vllm_config: VllmConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        # what an upstream model's loader reads of itself (``upstream_loader``)
        self.config = vllm_config.model_config.hf_config
        self.parallel_config = vllm_config.parallel_config
        self.quant_config = vllm_config.quant_config


def _layers_class(upstream: type[nn.Module] | None) -> type[_FFNLayers]:
    """``_FFNLayers``, or with ``upstream``'s ``load_weights`` and the helpers
    it calls on itself, so the upstream loading loop fills these layers'
    parameters, which carry its names."""
    if upstream is None:
        return _FFNLayers
    borrowed = {name: vars(upstream)[name] for name in class_loader_use(upstream).methods}
    return type(f"{upstream.__name__}FFNLayers", (_FFNLayers,), borrowed)


class FFNModel(nn.Module):
    """All decoder layers' FFNs of one checkpoint, called layer by layer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        model_config = vllm_config.model_config
        self.spec = get_afd_model_spec(model_config.architecture)
        self.num_layers = ffn_exchange_shape(vllm_config).num_layers
        """Exchanges per forward: the decoder layers' FFNs, or their parts."""
        self.hidden_size = model_config.get_hidden_size()
        self.gate_on_attention = vllm_config.afd_config.compute_gate_on_attention
        routing, config = self.spec.routing, model_config.hf_text_config
        self.moe_layers = [
            routing is not None and routing.is_moe_layer(config, i) for i in range(self.num_layers)
        ]
        if routing is not None:
            self.logits_dtype = routing.wire_dtype(config, model_config.dtype)
        self.token_id_columns = (
            token_id_columns(model_config.dtype) if self.spec.routes_by_token_id else 0
        )
        upstream = self.spec.upstream_loader
        decoder_layers = self.spec.num_decoder_layers(model_config)
        self.model = _layers_class(upstream() if upstream else None)(
            [self._build_layer(vllm_config, i) for i in range(decoder_layers)], vllm_config
        )
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        """Bytes of the FFN weights this process holds (its share in an FFN
        rank group). Counted as built: after loading, vLLM's CPU linear
        layers hand their weights to packed kernels and drop the parameters."""
        self.checkpoint_bytes_read = 0
        """Bytes of the checkpoint tensors the loader read for this process
        (those it left on disk never reach ``load_weights``)."""

    def _build_layer(self, vllm_config: VllmConfig, layer: int) -> nn.Module:
        prefix = f"model.layers.{layer}"
        name = self.spec.layer_ffn_name(vllm_config.model_config.hf_text_config, layer)
        if name is None:
            return self.spec.build_ffn(vllm_config, prefix)
        return _FFNLayer(name, self.spec.build_ffn(vllm_config, f"{prefix}.mlp"))

    def forward(self, layer: int, rows: torch.Tensor, stage: int = 0) -> torch.Tensor:
        """Exchange ``layer``'s FFN of the rows an attention peer sent in
        micro-batch stage ``stage``: hidden states, followed by router logits
        when the gate runs there, and by the token ids where the model routes
        by them. An exchange is a decoder layer's FFN, or one of its parts
        (``exchanges_per_layer``)."""
        if self.spec.exchanges_per_layer > 1:
            decoder_layer, part = divmod(layer, self.spec.exchanges_per_layer)
            return self.model.layers[decoder_layer](rows, part, stage)
        mlp = self.model.layers[layer].ffn_module
        if not (self.gate_on_attention or self.token_id_columns):
            return mlp(rows)
        token_ids = ()
        if self.token_id_columns:
            token_ids = (token_ids_from_wire(rows[:, -self.token_id_columns :]),)
            rows = rows[:, : -self.token_id_columns]
        hidden = _packed(rows[:, : self.hidden_size])
        if not self.gate_on_attention:
            return mlp(hidden, *token_ids)
        if not self.moe_layers[layer]:
            return mlp(hidden, *token_ids)  # the logits are padding
        # the logits' bytes, as RemoteMoE packed them
        logits = _packed(rows[:, self.hidden_size :]).view(self.logits_dtype)
        return self.spec.routing.experts_forward(mlp, hidden, logits, *token_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ffn_weights = (
            (name, w)
            for name, w in self._counted(weights)
            if is_ffn_weight(name, self.gate_on_attention, self.num_layers)
        )
        return AutoWeightsLoader(self).load_weights(
            ffn_weights, mapper=self.spec.weights_mapper(self.model.config)
        )

    def _counted(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, w in weights:
            self.checkpoint_bytes_read += w.numel() * w.element_size()
            yield name, w


def _packed(columns: torch.Tensor) -> torch.Tensor:
    """A copy of a column slice with rows packed end to end. ``contiguous()``
    returns a one-row slice as it is, with the full row's stride, which
    vLLM's CPU MoE kernel refuses (from 0.32)."""
    return columns.clone(memory_format=torch.contiguous_format)


def afd_role_model_class(vllm_config: VllmConfig, model_class: type[nn.Module]) -> type[nn.Module]:
    """The class the model loader builds: the FFN-only model on the FFN role,
    the architecture's own class otherwise (the attention side's layers swap
    their FFN for ``RemoteFFN`` while they are built)."""
    afd = vllm_config.afd_config
    if afd is None or afd.role != "ffn":
        return model_class
    return FFNModel
