# SPDX-License-Identifier: Apache-2.0
"""What an architecture's entry in the registry says, and the builders its
entries share: each builds a part as the upstream model does, from the
class it names, so a new architecture is mostly a table entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.models.utils import WeightsMapper

MODELS = "vllm.model_executor.models"
"""vLLM's package of model files, whose classes the builders import by name."""


TOKEN_ID_DTYPE = torch.int32
"""How a token id travels to the FFN side (vocabularies stay below 2**31)."""


def token_id_columns(model_dtype: torch.dtype) -> int:
    """Columns of ``model_dtype`` that one row's token id takes on the wire."""
    return TOKEN_ID_DTYPE.itemsize // model_dtype.itemsize


def token_ids_on_wire(input_ids: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """Attention side: the token ids as columns of ``model_dtype``, bit for bit."""
    return input_ids.to(TOKEN_ID_DTYPE).reshape(-1, 1).view(model_dtype)


def token_ids_from_wire(columns: torch.Tensor) -> torch.Tensor:
    """FFN side: the token ids ``token_ids_on_wire`` packed, as the int64 ids
    the upstream model hands its FFN."""
    return columns.contiguous().view(TOKEN_ID_DTYPE).reshape(-1).to(torch.int64)


@dataclass(frozen=True)
class MoERouting:
    """Where a MoE architecture's router can run. With
    ``compute_gate_on_attention`` the attention side applies the router gate
    and sends its logits; the FFN side feeds them to the experts. Top-k
    selection, grouped routing and the correction bias stay with the
    experts on the FFN side in both placements."""

    is_moe_layer: Callable[[PretrainedConfig, int], bool]
    """Whether decoder layer N has a routed MoE block (else a dense MLP)."""

    num_experts: Callable[[PretrainedConfig], int]
    """Width of the router logits."""

    build_gate: Callable[[VllmConfig, str], nn.Module]
    """Builds the router gate of a MoE block as upstream does, from the
    block's prefix ``model.layers.N.mlp`` (parameters under ``gate_name``)."""

    experts_forward: Callable[..., torch.Tensor]
    """FFN side: the block's output from hidden states and router logits
    computed elsewhere (the block's own forward minus its gate), and the
    rows' token ids where the spec ``routes_by_token_id``."""

    remote_parts: tuple[str, ...]
    """The block's children other than the gate (experts, shared experts):
    placeholders on the attention side, so their weights are skipped."""

    router_logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = (
        lambda gate, hidden: gate(hidden)[0]  # a vLLM linear layer: (output, bias)
    )
    """Attention side: the gate's logits of the hidden states, as the block's
    forward computes them (default: a vLLM linear layer's first output)."""

    gate_name: str = "gate"
    """The block's attribute, and the checkpoint's name, for the router gate
    (gpt-oss calls it ``router``)."""

    logits_dtype: Callable[[PretrainedConfig], torch.dtype | None] = lambda config: None
    """The dtype in which the block's gate computes the logits and its
    experts take them (None: the model's). A float32 router's logits travel
    bit for bit (``router_logit_columns``): rounded to a 16-bit model dtype
    they pick other experts than the block does."""

    def wire_dtype(self, config: PretrainedConfig, model_dtype: torch.dtype) -> torch.dtype:
        return self.logits_dtype(config) or model_dtype

    def router_logit_columns(self, config: PretrainedConfig, model_dtype: torch.dtype) -> int:
        """Columns of ``model_dtype`` that one token's logits take on the
        wire: the experts' count, twice that for float32 logits of a 16-bit
        model (their bytes, viewed as the model's dtype)."""
        itemsize = self.wire_dtype(config, model_dtype).itemsize
        return self.num_experts(config) * itemsize // model_dtype.itemsize


@dataclass(frozen=True)
class AFDModelSpec:
    """How one architecture's FFN is built on the FFN side."""

    build_ffn: Callable[[VllmConfig, str], nn.Module]
    """Builds the FFN of one decoder layer, as the upstream layer does, from
    the config and its parameter prefix ``model.layers.N.mlp``."""

    weights_mapper: Callable[[PretrainedConfig], WeightsMapper]
    """The upstream model's checkpoint-name mapper (stacked projections),
    for the checkpoint's config (DeepSeek-V4's depends on its experts'
    dtype)."""

    routing: MoERouting | None = None
    """For MoE architectures: where the router may run."""

    ffn_name: str | Callable[[PretrainedConfig, int], str] | None = "mlp"
    """The decoder layer's attribute, and the checkpoint's name, for its FFN
    (MiniMax-M2 calls it ``block_sparse_moe``); a function of the config and
    the layer's index where it differs between layers (MiniMax-M3: ``mlp``
    in dense layers, ``block_sparse_moe`` in MoE layers). None: the FFN
    side's layer is what ``build_ffn`` builds from the decoder layer's
    prefix ``model.layers.N``, its FFN parts under their own names. Read it
    through ``layer_ffn_name``."""

    exchanges_per_layer: int = 1
    """Exchanges with the FFN side per decoder layer. Above 1 (LongCat-Flash:
    one after each of its two attentions; ``shortcut_moe``) the layer built
    by ``build_ffn`` takes ``(rows, part, stage)``."""

    num_decoder_layers: Callable[[ModelConfig], int] = lambda model: (
        model.get_total_num_hidden_layers()
    )
    """The model's decoder layers (LongCat-Flash's config counts each
    layer's attentions as its ``num_hidden_layers``, and vLLM's count of
    them differs between releases)."""

    routes_by_token_id: bool = False
    """Whether the FFN takes each row's token id besides its hidden states
    (DeepSeek-V4's first ``num_hash_layers`` MoE layers pick their experts
    by token id). The rows then carry it in their last columns
    (``TOKEN_ID_DTYPE``'s bytes viewed as the model's dtype), on every
    layer, so that every exchange has one width."""

    refusal: Callable[[], str | None] = lambda: None
    """Why this vLLM release's model of the architecture cannot be split
    (its model file has a form the series has no hook for), or None."""

    upstream_loader: Callable[[], type[nn.Module]] | None = None
    """For checkpoints whose FFN tensors only the upstream model's own
    loading loop takes (gpt-oss: fused 3-D expert tensors with their biases,
    transposed and sliced per rank): that model class. The FFN side's layers
    borrow its ``load_weights`` and the helpers it calls on itself
    (``upstream_loader.py``), which read their ``config``,
    ``parallel_config`` and the parameters under ``layers.N.mlp``."""

    def layer_ffn_name(self, config: PretrainedConfig, layer: int) -> str | None:
        """``ffn_name`` of decoder layer ``layer``."""
        if callable(self.ffn_name):
            return self.ffn_name(config, layer)
        return self.ffn_name


def dense_mlp(module: str, class_name: str, **config_kwargs: str):
    """A builder for a gated MLP class that takes hidden size, intermediate
    size and activation; ``config_kwargs`` maps extra arguments to config
    attributes (False when absent)."""

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_text_config
        mlp_class = getattr(importlib.import_module(module), class_name)
        extra = {arg: getattr(config, attr, False) for arg, attr in config_kwargs.items()}
        return mlp_class(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
            **extra,
        )

    return build


def replicated_gate(
    num_experts: Callable[[PretrainedConfig], int], name: str = "gate", bias: bool = False
):
    """A router gate built as Qwen's MoE blocks build theirs (a
    ``ReplicatedLinear``), or with ``bias`` and no quantization, as gpt-oss's
    ``router`` is."""

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        from vllm.model_executor.layers.linear import ReplicatedLinear

        config = vllm_config.model_config.hf_text_config
        return ReplicatedLinear(
            config.hidden_size,
            num_experts(config),
            bias=bias,
            quant_config=None if bias else vllm_config.quant_config,
            prefix=f"{prefix}.{name}",
        )

    return build


def moe_ffn(
    build_block: Callable[[VllmConfig, str], nn.Module],
    build_dense: Callable[[VllmConfig, str], nn.Module] | None,
    routing: MoERouting,
):
    """A builder for a model whose MoE layers are ``build_block`` and whose
    other layers (none if None) are ``build_dense``. With the gate on the
    attention side the block's experts stop routing for themselves."""

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        from vllm.model_executor.models.utils import extract_layer_index

        config = vllm_config.model_config.hf_text_config
        if not routing.is_moe_layer(config, extract_layer_index(prefix)):
            assert build_dense is not None, f"{prefix}: a dense layer in an all-MoE model"
            return build_dense(vllm_config, prefix)
        block = build_block(vllm_config, prefix)
        if vllm_config.afd_config.compute_gate_on_attention:
            block.experts.gate = None  # FusedMoE takes the router logits it is given
            # The gate's weight and bias live on the attention side only; what
            # routing still needs here (a correction bias) stays under the
            # gate's name.
            kept = nn.Module()
            gate = getattr(block, routing.gate_name)
            for name, param in gate.named_parameters(recurse=False):
                if name not in ("weight", "bias"):
                    kept.register_parameter(name, param)
            setattr(block, routing.gate_name, kept)
        return block

    return build


def moe_block(module: str, class_name: str, with_vllm_config: bool = True):
    """A MoE block built as its decoder layer builds it."""

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        block_class = getattr(importlib.import_module(module), class_name)
        if with_vllm_config:
            return block_class(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_text_config
        return block_class(config=config, quant_config=vllm_config.quant_config, prefix=prefix)

    return build


def experts_only(block: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``experts_forward`` of a block whose forward, after its gate, only
    calls its experts (FusedMoE, shared experts included)."""
    return block.experts(hidden_states=hidden, router_logits=logits)


def mapper_of(module: str, class_name: str, layers_parent: str | None = None):
    """The upstream class's checkpoint-name mapper; with ``layers_parent``,
    for a checkpoint whose decoder layers are under it (a vision-language
    model's ``model.language_model.``) rather than under ``model.``."""

    def mapper(config: PretrainedConfig) -> WeightsMapper:
        from vllm.model_executor.models.utils import WeightsMapper

        upstream = getattr(importlib.import_module(module), class_name).hf_to_vllm_mapper
        if layers_parent is None:
            return upstream
        return WeightsMapper(orig_to_new_prefix={layers_parent: "model."}) | upstream

    return mapper


def under(parents: tuple[str, ...], mapper: Callable[[PretrainedConfig], WeightsMapper]):
    """``mapper`` for a checkpoint whose decoder layers are under one of
    ``parents`` (a vision-language model's language model) rather than
    under ``model.``."""

    def mapper_under(config: PretrainedConfig) -> WeightsMapper:
        from vllm.model_executor.models.utils import WeightsMapper

        prefixes = WeightsMapper(orig_to_new_prefix=dict.fromkeys(parents, "model."))
        return prefixes | mapper(config)

    return mapper_under
