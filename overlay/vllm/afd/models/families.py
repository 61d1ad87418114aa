# SPDX-License-Identifier: Apache-2.0
"""What differs between the MoE families AFD splits: which layers are MoE,
how each builds its router gate and block, and how its experts run on
logits computed elsewhere. Each is upstream's rule or construction, read
from the family's model file, so the two roles route as the model does.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.afd.models.spec import MODELS, MoERouting, experts_only, replicated_gate

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.model_executor.models.utils import WeightsMapper


def _qwen_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """Qwen2-MoE's and Qwen3-MoE's rule: a sparse MoE block unless the layer
    is in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    return layer not in getattr(config, "mlp_only_layers", []) and (
        config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0
    )


QWEN_MOE_ROUTING = MoERouting(
    is_moe_layer=_qwen_moe_layer,
    num_experts=lambda config: config.num_experts,
    build_gate=replicated_gate(lambda config: config.num_experts),
    experts_forward=experts_only,
    remote_parts=("experts", "shared_expert", "shared_expert_gate"),
)


# Qwen3.5-MoE: Qwen's routing, every layer MoE (its config has no
# ``decoder_sparse_step`` or ``mlp_only_layers``).
QWEN3_5_MOE_ROUTING = dataclasses.replace(QWEN_MOE_ROUTING, is_moe_layer=lambda config, layer: True)


def _dense_below_first_k(config: PretrainedConfig, layer: int) -> bool:
    """DeepseekV2DecoderLayer's rule (DeepSeek-V2/V3) and Glm4MoeDecoderLayer's:
    dense below ``first_k_dense_replace``, then MoE, every ``moe_layer_freq``
    layers where the config sets it (GLM-4.5's never does)."""
    return (
        config.n_routed_experts is not None
        and layer >= config.first_k_dense_replace
        and layer % getattr(config, "moe_layer_freq", 1) == 0
    )


def _deepseek_router_dtype(config: PretrainedConfig) -> torch.dtype | None:
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2._get_moe_router_dtype(config)


def _deepseek_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.models import deepseek_v2

    config = vllm_config.model_config.hf_text_config
    return deepseek_v2.GateLinear(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=_deepseek_router_dtype(config),
        prefix=f"{prefix}.gate",
    )


def deepseek_moe_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2.DeepseekV2MoE(
        config=vllm_config.model_config.hf_text_config,
        parallel_config=vllm_config.parallel_config,
        quant_config=vllm_config.quant_config,
        prefix=prefix,
        apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
    )


def deepseek_mapper(config: PretrainedConfig) -> WeightsMapper:
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


DEEPSEEK_ROUTING = MoERouting(
    is_moe_layer=_dense_below_first_k,
    num_experts=lambda config: config.n_routed_experts,
    build_gate=_deepseek_gate,
    experts_forward=experts_only,
    remote_parts=("experts", "shared_experts"),
    logits_dtype=_deepseek_router_dtype,
)


def _glm4_moe_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """Glm4MoE's float32 gate: a ``GateLinear`` where the release builds one
    (0.32), else (0.26) a plain ``nn.Linear``, applied to the hidden states
    cast to float32 (``_glm4_moe_logits``)."""
    glm4_moe = importlib.import_module(f"{MODELS}.glm4_moe")
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
GLM4_MOE_ROUTING = dataclasses.replace(
    DEEPSEEK_ROUTING,
    build_gate=_glm4_moe_gate,
    router_logits=_glm4_moe_logits,
    logits_dtype=lambda config: torch.float32,
)


def gpt_oss_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.models.gpt_oss import MLPBlock
    from vllm.model_executor.models.utils import extract_layer_index

    return MLPBlock(vllm_config, extract_layer_index(prefix), prefix=prefix)


def _gpt_oss_experts(block: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    # MLPBlock's forward after its router: the experts may pad the hidden size
    return block.experts(hidden_states=hidden, router_logits=logits)[:, : block.hidden_size]


GPT_OSS_ROUTING = MoERouting(
    is_moe_layer=lambda config, layer: True,
    num_experts=lambda config: config.num_local_experts,
    build_gate=replicated_gate(lambda config: config.num_local_experts, "router", bias=True),
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
MINIMAX_M2_ROUTING = MoERouting(
    is_moe_layer=lambda config, layer: True,
    num_experts=lambda config: config.num_local_experts,
    build_gate=_minimax_m2_gate,
    experts_forward=experts_only,
    remote_parts=("experts",),
    logits_dtype=lambda config: torch.float32,
)


def _deepseek_v4_model():
    """The platform's DeepSeek-V4 model module, the one vLLM's registry builds
    (``vllm.models.deepseek_v4`` picks it: ``nvidia``, ``amd`` or ``xpu``)."""
    import sys

    from vllm.models import deepseek_v4

    return sys.modules[deepseek_v4.DeepseekV4ForCausalLM.__module__]


def deepseek_v4_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    return _deepseek_v4_model().DeepseekV4MoE(vllm_config, prefix=prefix)


def _deepseek_v4_gate(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    config = vllm_config.model_config.hf_text_config
    return GateLinear(
        input_size=config.hidden_size,
        output_size=config.n_routed_experts,
        bias=False,
        out_dtype=torch.float32,
        prefix=f"{prefix}.gate",
    )


def _deepseek_v4_experts(
    block: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    # DeepseekV4MoE's forward after its gate: the hash layers' experts are
    # picked by token id (the gate's table), their weights by the logits.
    return block.experts(hidden_states=hidden, router_logits=logits, input_ids=token_ids)


def deepseek_v4_refusal() -> str | None:
    """Patch 0031 hooks the NVIDIA model file of vLLM 0.26, whose MoE forward
    takes hidden states and token ids alone; from vLLM 0.32 it takes MegaMoE
    gate metadata too, the series leaves the patch out there, and the CPU
    model file (0.32 on) has no hook either."""
    import inspect

    module = _deepseek_v4_model()
    if "remote_ffn(" in inspect.getsource(module):
        return None
    return (
        f"this vLLM's DeepSeek-V4 model ({module.__name__}) has no AFD hook: patch 0031 "
        "hooks vLLM 0.26.0's NVIDIA model, and later releases changed its MoE forward "
        "(MegaMoE gate metadata, fused shared experts); run DeepSeek-V4 under AFD on "
        "vLLM 0.26.0 with GPUs"
    )


def deepseek_v4_mapper(config: PretrainedConfig) -> WeightsMapper:
    """DeepSeek-V4's own mapper for the checkpoint's experts' dtype (its
    scales' names differ), as ``DeepseekV4ForCausalLM`` picks it, plus what
    its model's loading loop does by hand: the shared experts' ``w1`` and
    ``w3`` stacked, the routed experts' ``w1``/``w3``/``w2`` under the names
    FusedMoE loads."""
    from vllm.model_executor.models.utils import WeightsMapper

    expert_dtype = getattr(config, "expert_dtype", "fp4")
    upstream = _deepseek_v4_model()._make_deepseek_v4_weights_mapper(expert_dtype)
    stacked = {
        ".shared_experts.w1": (".shared_experts.gate_up_proj", 0),
        ".shared_experts.w3": (".shared_experts.gate_up_proj", 1),
    }
    return upstream | _experts_as_fused_moe_names() | WeightsMapper(orig_to_new_stacked=stacked)


def _experts_as_fused_moe_names() -> WeightsMapper:
    """Routed experts stored as ``experts.E.w1``/``w3``/``w2`` (gate, up,
    down) under the names a FusedMoE built with its default checkpoint names
    loads, as the upstream models' own loading loops map them."""
    import re

    from vllm.model_executor.models.utils import WeightsMapper

    experts = {
        re.compile(rf"(\.experts\.\d+\.){name}\."): rf"\1{fused_moe_name}."
        for name, fused_moe_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    }
    return WeightsMapper(orig_to_new_regex=experts)


# DeepSeek-V4: every layer MoE; sqrt-softplus scores with a correction bias,
# except the first ``num_hash_layers``, whose experts are a table's entry for
# the token id (``tid2eid``), weighted by the scores. Both stay under the
# gate's name on the FFN side, with the experts.
DEEPSEEK_V4_ROUTING = MoERouting(
    is_moe_layer=lambda config, layer: True,
    num_experts=lambda config: config.n_routed_experts,
    build_gate=_deepseek_v4_gate,
    experts_forward=_deepseek_v4_experts,
    remote_parts=("experts", "shared_experts"),
    logits_dtype=lambda config: torch.float32,
)


def _minimax_m3_model():
    """The platform's MiniMax-M3 model module, the one vLLM's registry builds
    (``vllm.models.minimax_m3`` picks it: ``nvidia`` or ``amd``). Imported
    when a role builds the model: it imports CUDA-only ops, so on a CPU it
    does not import at all."""
    import sys

    from vllm.models import minimax_m3

    return sys.modules[minimax_m3.MiniMaxM3SparseForCausalLM.__module__]


def _minimax_m3_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """MiniMax-M3's rule (``_is_moe_layer``): MoE where ``moe_layer_freq``
    is non-zero, every layer where the config has no such list."""
    moe_layer_freq = getattr(config, "moe_layer_freq", None)
    return moe_layer_freq is None or moe_layer_freq[layer] != 0


def minimax_m3_ffn_name(config: PretrainedConfig, layer: int) -> str:
    """A MiniMax-M3 decoder layer's name for its FFN, as its checkpoint's."""
    return "block_sparse_moe" if _minimax_m3_moe_layer(config, layer) else "mlp"


def minimax_m3_block(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """A MiniMax-M3 MoE block as its decoder layer builds it, its output
    reduced over the FFN rank group (the layer defers that all-reduce to
    its next norm, which the FFN side does not run)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return _minimax_m3_model().MiniMaxM3MoE(
        config=vllm_config.model_config.hf_text_config,
        layer_id=extract_layer_index(prefix),
        quant_config=vllm_config.quant_config,
        reduce_results=True,
        prefix=prefix,
    )


def minimax_m3_mlp(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """A MiniMax-M3 dense layer's MLP, as its decoder layer builds it,
    reduced as ``minimax_m3_block``."""
    config = vllm_config.model_config.hf_text_config
    return _minimax_m3_model().MiniMaxM3MLP(
        config=config,
        intermediate_size=config.dense_intermediate_size,
        quant_config=vllm_config.quant_config,
        reduce_results=True,
        prefix=prefix,
    )


def minimax_m3_mapper(config: PretrainedConfig) -> WeightsMapper:
    """What MiniMax-M3's loading loop does by hand to its FFN tensors: the
    dense MLPs' and shared experts' gate and up projections stacked (as
    DeepSeek's), the routed experts' ``w1``/``w3``/``w2`` under FusedMoE's
    names, block scales' ``weight_scale_inv`` read as ``weight_scale``."""
    from vllm.model_executor.models.utils import WeightsMapper

    scales = WeightsMapper(orig_to_new_substr={".weight_scale_inv": ".weight_scale"})
    return scales | _experts_as_fused_moe_names() | deepseek_mapper(config)


def minimax_m3_refusal() -> str | None:
    """Patch 0032 hooks the NVIDIA model file of vLLM 0.26 to 0.33. From
    0.34 its decoder layer may hand an unfinished MoE output to the next
    layer's norm, shards the rows over sequence-parallel ranks, and asks the
    MoE block itself whether its all-reduce is deferred; the series leaves
    the patch out there, and the AMD model file has no hook. Read as text:
    the module does not import without CUDA."""
    from pathlib import Path

    import vllm
    from vllm.platforms import current_platform

    platform = "amd" if current_platform.is_rocm() else "nvidia"
    model_file = Path(vllm.__file__).parent / "models" / "minimax_m3" / platform / "model.py"
    if "remote_ffn(" in model_file.read_text():
        return None
    return (
        f"this vLLM's MiniMax-M3 model (vllm.models.minimax_m3.{platform}.model) has no AFD "
        "hook: patch 0032 hooks the NVIDIA model of vLLM 0.26.0 to 0.33.0, and vLLM 0.34.0 "
        "changed its decoder layer (unfinished MoE outputs handed to the next layer's norm, "
        "sequence parallelism); run MiniMax-M3 under AFD on vLLM 0.26.0 to 0.33.0 with "
        "NVIDIA GPUs"
    )


# MiniMax-M3: MiniMax-M2's float32 gate and sigmoid routing with the
# correction bias on the block; dense layers where ``moe_layer_freq`` is 0,
# and a shared expert that FusedMoE runs with the routed ones.
MINIMAX_M3_ROUTING = dataclasses.replace(
    MINIMAX_M2_ROUTING,
    is_moe_layer=_minimax_m3_moe_layer,
    remote_parts=("experts", "shared_experts"),
)
