# SPDX-License-Identifier: Apache-2.0
"""The architectures AFD can split, and how each role builds its part.

The FFN side builds each layer's FFN with the same class and arguments as
the upstream decoder layer, under the same parameter names, so checkpoints
load unchanged. The attention side needs the one-line hook in the model file
(see ``remote_ffn``) and, for MoE models with the router gate on its side,
the gate as upstream builds it (``MoERouting``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.model_executor.models.utils import WeightsMapper


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

    experts_forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    """FFN side: the block's output from hidden states and router logits
    computed elsewhere (the block's own forward minus its gate)."""

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

    weights_mapper: Callable[[], WeightsMapper]
    """The upstream model's checkpoint-name mapper (stacked projections)."""

    routing: MoERouting | None = None
    """For MoE architectures: where the router may run."""

    ffn_name: str = "mlp"
    """The decoder layer's attribute, and the checkpoint's name, for its FFN
    (MiniMax-M2 calls it ``block_sparse_moe``)."""

    upstream_loader: Callable[[], type[nn.Module]] | None = None
    """For checkpoints whose FFN tensors only the upstream model's own
    loading loop takes (gpt-oss: fused 3-D expert tensors with their biases,
    transposed and sliced per rank): that model class. The FFN side's layers
    borrow its ``load_weights`` and the helpers it calls on itself
    (``upstream_loader.py``), which read their ``config``,
    ``parallel_config`` and the parameters under ``layers.N.mlp``."""


def _dense_mlp(module: str, class_name: str, **config_kwargs: str):
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


def _qwen_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """Qwen2-MoE's and Qwen3-MoE's rule: a sparse MoE block unless the layer
    is in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    return layer not in getattr(config, "mlp_only_layers", []) and (
        config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0
    )


def _replicated_gate(
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


def _moe_ffn(
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


def _block(module: str, class_name: str, with_vllm_config: bool = True):
    """A MoE block built as its decoder layer builds it."""

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        block_class = getattr(importlib.import_module(module), class_name)
        if with_vllm_config:
            return block_class(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_text_config
        return block_class(config=config, quant_config=vllm_config.quant_config, prefix=prefix)

    return build


def _experts_only(block: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return block.experts(hidden_states=hidden, router_logits=logits)


_QWEN_MOE_ROUTING = MoERouting(
    is_moe_layer=_qwen_moe_layer,
    num_experts=lambda config: config.num_experts,
    build_gate=_replicated_gate(lambda config: config.num_experts),
    experts_forward=_experts_only,
    remote_parts=("experts", "shared_expert", "shared_expert_gate"),
)


def _dense_below_first_k(config: PretrainedConfig, layer: int) -> bool:
    """DeepseekV2DecoderLayer's rule (DeepSeek-V2/V3) and Glm4MoeDecoderLayer's:
    dense below ``first_k_dense_replace``, then MoE, every ``moe_layer_freq``
    layers where the config sets it (GLM-4.5's never does)."""
    return (
        config.n_routed_experts is not None
        and layer >= config.first_k_dense_replace
        and layer % getattr(config, "moe_layer_freq", 1) == 0
    )


def _deepseek_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.models import deepseek_v2

    config = vllm_config.model_config.hf_text_config
    return deepseek_v2.GateLinear(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=_deepseek_router_dtype(config),
        prefix=f"{prefix}.gate",
    )


def _deepseek_moe_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2.DeepseekV2MoE(
        config=vllm_config.model_config.hf_text_config,
        parallel_config=vllm_config.parallel_config,
        quant_config=vllm_config.quant_config,
        prefix=prefix,
        apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
    )


def _deepseek_mapper():
    """DeepSeek-V2 loads with its own loop; these are its stacked MLP
    projections (routed experts are loaded by FusedMoE itself)."""
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper(
        orig_to_new_stacked={
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0),
            ".shared_experts.up_proj": (".shared_experts.gate_up_proj", 1),
        }
    )


def _under(parents: tuple[str, ...], mapper: Callable[[], WeightsMapper]):
    """``mapper`` for a checkpoint whose decoder layers are under one of
    ``parents`` (a vision-language model's language model) rather than
    under ``model.``."""

    def under() -> WeightsMapper:
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper(orig_to_new_prefix=dict.fromkeys(parents, "model.")) | mapper()

    return under


def _deepseek_router_dtype(config: PretrainedConfig) -> torch.dtype | None:
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2._get_moe_router_dtype(config)


_DEEPSEEK_ROUTING = MoERouting(
    is_moe_layer=_dense_below_first_k,
    num_experts=lambda config: config.n_routed_experts,
    build_gate=_deepseek_gate,
    experts_forward=_experts_only,
    remote_parts=("experts", "shared_experts"),
    logits_dtype=_deepseek_router_dtype,
)


def _glm4_moe_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """Glm4MoE's float32 gate: a ``GateLinear`` where the release builds one
    (0.32), else (0.26) a plain ``nn.Linear``, applied to the hidden states
    cast to float32 (``_glm4_moe_logits``)."""
    glm4_moe = importlib.import_module(f"{_MODELS}.glm4_moe")
    config = vllm_config.model_config.hf_text_config
    if not hasattr(glm4_moe, "GateLinear"):
        return nn.Linear(
            config.hidden_size, config.n_routed_experts, bias=False, dtype=torch.float32
        )
    return glm4_moe.GateLinear(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=torch.float32,
        params_dtype=torch.float32,
        prefix=f"{prefix}.gate",
    )


def _glm4_moe_logits(gate: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if isinstance(gate, nn.Linear):
        return gate(hidden.to(torch.float32))
    return gate(hidden)[0]


# DeepSeek's layer rule, experts and parts, with GLM-4.5's gate.
_GLM4_MOE_ROUTING = dataclasses.replace(
    _DEEPSEEK_ROUTING,
    build_gate=_glm4_moe_gate,
    router_logits=_glm4_moe_logits,
    logits_dtype=lambda config: torch.float32,
)


def _gpt_oss_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.models.gpt_oss import MLPBlock
    from vllm.model_executor.models.utils import extract_layer_index

    return MLPBlock(vllm_config, extract_layer_index(prefix), prefix=prefix)


def _gpt_oss_experts(block: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    # MLPBlock's forward after its router: the experts may pad the hidden size
    return block.experts(hidden_states=hidden, router_logits=logits)[:, : block.hidden_size]


_GPT_OSS_ROUTING = MoERouting(
    is_moe_layer=lambda config, layer: True,
    num_experts=lambda config: config.num_local_experts,
    build_gate=_replicated_gate(lambda config: config.num_local_experts, "router", bias=True),
    experts_forward=_gpt_oss_experts,
    remote_parts=("experts",),
    gate_name="router",
)


def _minimax_m2_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    config = vllm_config.model_config.hf_text_config
    return GateLinear(
        config.hidden_size,
        config.num_local_experts,
        bias=False,
        params_dtype=torch.float32,
        out_dtype=torch.float32,
        prefix=f"{prefix}.gate",
    )


# MiniMax-M2: every layer MoE, sigmoid scores with a correction bias that
# the block (not its gate) holds, a float32 gate.
_MINIMAX_M2_ROUTING = MoERouting(
    is_moe_layer=lambda config, layer: True,
    num_experts=lambda config: config.num_local_experts,
    build_gate=_minimax_m2_gate,
    experts_forward=_experts_only,
    remote_parts=("experts",),
    logits_dtype=lambda config: torch.float32,
)


def _mapper_of(module: str, class_name: str, layers_parent: str | None = None):
    """The upstream class's checkpoint-name mapper; with ``layers_parent``,
    for a checkpoint whose decoder layers are under it (a vision-language
    model's ``model.language_model.``) rather than under ``model.``."""

    def mapper():
        from vllm.model_executor.models.utils import WeightsMapper

        upstream = getattr(importlib.import_module(module), class_name).hf_to_vllm_mapper
        if layers_parent is None:
            return upstream
        return WeightsMapper(orig_to_new_prefix={layers_parent: "model."}) | upstream

    return mapper


_MODELS = "vllm.model_executor.models"

# Qwen3.5-MoE: Qwen's routing, every layer MoE (its config has no
# ``decoder_sparse_step`` or ``mlp_only_layers``).
_QWEN3_5_MOE_ROUTING = dataclasses.replace(
    _QWEN_MOE_ROUTING, is_moe_layer=lambda config, layer: True
)

_DEEPSEEK_SPEC = AFDModelSpec(
    _moe_ffn(
        _deepseek_moe_block,
        _dense_mlp(f"{_MODELS}.deepseek_v2", "DeepseekV2MLP"),
        _DEEPSEEK_ROUTING,
    ),
    _deepseek_mapper,
    _DEEPSEEK_ROUTING,
)

SUPPORTED_ARCHITECTURES: dict[str, AFDModelSpec] = {
    "Qwen3ForCausalLM": AFDModelSpec(
        _dense_mlp(f"{_MODELS}.qwen2", "Qwen2MLP"),
        _mapper_of(f"{_MODELS}.qwen2", "Qwen2Model"),
    ),
    "LlamaForCausalLM": AFDModelSpec(
        _dense_mlp(f"{_MODELS}.llama", "LlamaMLP", bias="mlp_bias"),
        _mapper_of(f"{_MODELS}.llama", "LlamaModel"),
    ),
    "Qwen3MoeForCausalLM": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.qwen3_moe", "Qwen3MoeSparseMoeBlock"),
            _dense_mlp(f"{_MODELS}.qwen3_moe", "Qwen3MoeMLP"),
            _QWEN_MOE_ROUTING,
        ),
        _mapper_of(f"{_MODELS}.qwen3_moe", "Qwen3MoeModel"),
        _QWEN_MOE_ROUTING,
    ),
    # Qwen3-Next: Qwen2-MoE's gated shared expert and routing behind hybrid
    # linear (gated delta net) and full attention, which stay on the
    # attention side with their state.
    "Qwen3NextForCausalLM": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.qwen3_next", "Qwen3NextSparseMoeBlock"),
            _dense_mlp(f"{_MODELS}.qwen2_moe", "Qwen2MoeMLP"),
            _QWEN_MOE_ROUTING,
        ),
        _mapper_of(f"{_MODELS}.qwen3_next", "Qwen3NextModel"),
        _QWEN_MOE_ROUTING,
    ),
    # Qwen3.5-MoE: Qwen3-Next's layers and MoE block (every layer) as the
    # language model of a vision-language model; the vision tower stays on
    # the attention side, the FFN side reads the layers under
    # ``model.language_model.``.
    "Qwen3_5MoeForConditionalGeneration": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.qwen3_next", "Qwen3NextSparseMoeBlock"), None, _QWEN3_5_MOE_ROUTING
        ),
        _mapper_of(f"{_MODELS}.qwen3_5", "Qwen3_5Model", layers_parent="model.language_model."),
        _QWEN3_5_MOE_ROUTING,
    ),
    "Qwen2MoeForCausalLM": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.qwen2_moe", "Qwen2MoeSparseMoeBlock", with_vllm_config=False),
            _dense_mlp(f"{_MODELS}.qwen2_moe", "Qwen2MoeMLP"),
            _QWEN_MOE_ROUTING,
        ),
        _mapper_of(f"{_MODELS}.qwen2_moe", "Qwen2MoeForCausalLM"),
        _QWEN_MOE_ROUTING,
    ),
    # DeepSeek-V3 (and R1, V3.1, Kimi-K2) is DeepSeek-V2's model class with
    # sigmoid routing and a correction bias (``topk_method: noaux_tc``), which
    # DeepseekV2MoE keeps on its gate: the FFN side loads it in both placements.
    "DeepseekV2ForCausalLM": _DEEPSEEK_SPEC,
    "DeepseekV3ForCausalLM": _DEEPSEEK_SPEC,
    # DeepSeek-V3.2 is V3's model class with DeepSeek Sparse Attention: the
    # indexer and its key cache belong to the attention, which stays on the
    # attention side; the FFN is V3's.
    "DeepseekV32ForCausalLM": _DEEPSEEK_SPEC,
    # GLM-5 is DeepSeek-V2's model class with DeepSeek Sparse Attention (as
    # V3.2) and GLM's float32 router, which DeepSeek's spec reads from
    # vLLM's own rule (``_get_moe_router_dtype``).
    "GlmMoeDsaForCausalLM": _DEEPSEEK_SPEC,
    # Kimi-K2.5: DeepSeek-V3's language model under a vision wrapper, its
    # decoder layers under ``language_model.model.``; the MoonViT tower and
    # its projector stay on the attention side.
    "KimiK25ForConditionalGeneration": dataclasses.replace(
        _DEEPSEEK_SPEC,
        weights_mapper=_under(("language_model.model.",), _deepseek_mapper),
    ),
    "Glm4MoeForCausalLM": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.glm4_moe", "Glm4MoE", with_vllm_config=False),
            _dense_mlp(f"{_MODELS}.glm4_moe", "Glm4MoeMLP"),
            _GLM4_MOE_ROUTING,
        ),
        _mapper_of(f"{_MODELS}.glm4_moe", "Glm4MoeModel"),
        _GLM4_MOE_ROUTING,
    ),
    # gpt-oss: every layer a MoE block whose router has a bias and whose
    # experts have biases and the clamped SwiGLU; attention sinks and sliding
    # windows stay on the attention side.
    "MiniMaxM2ForCausalLM": AFDModelSpec(
        _moe_ffn(
            _block(f"{_MODELS}.minimax_m2", "MiniMaxM2MoE", with_vllm_config=False),
            None,
            _MINIMAX_M2_ROUTING,
        ),
        _mapper_of(f"{_MODELS}.minimax_m2", "MiniMaxM2Model"),
        _MINIMAX_M2_ROUTING,
        ffn_name="block_sparse_moe",
    ),
    "GptOssForCausalLM": AFDModelSpec(
        _moe_ffn(_gpt_oss_block, None, _GPT_OSS_ROUTING),
        _mapper_of(f"{_MODELS}.gpt_oss", "GptOssForCausalLM"),
        _GPT_OSS_ROUTING,
        upstream_loader=lambda: importlib.import_module(f"{_MODELS}.gpt_oss").GptOssModel,
    ),
}


def ffn_input_width(vllm_config: VllmConfig) -> int:
    """Columns of the rows the attention side sends: the hidden size, plus
    the router logits when the gate runs on the attention side."""
    model = vllm_config.model_config
    width = model.get_hidden_size()
    if vllm_config.afd_config.compute_gate_on_attention:
        routing = get_afd_model_spec(model.architecture).routing
        width += routing.router_logit_columns(model.hf_text_config, model.dtype)
    return width


def get_afd_model_spec(architecture: str) -> AFDModelSpec:
    try:
        return SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"AFD does not support the architecture {architecture!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        ) from None
