# SPDX-License-Identifier: Apache-2.0
"""The architectures AFD can split, and how each role builds its part.

The FFN side builds each layer's FFN with the same class and arguments as
the upstream decoder layer, under the same parameter names, so checkpoints
load unchanged. The attention side needs the one-line hook in the model file
(see ``remote_ffn``) and, for MoE models with the router gate on its side,
the gate as upstream builds it (``MoERouting``). An entry is put together
from the shared builders (``spec``) and its family's routing (``families``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from vllm.afd.models.families import (
    DEEPSEEK_ROUTING,
    DEEPSEEK_V4_ROUTING,
    GLM4_MOE_ROUTING,
    GPT_OSS_ROUTING,
    MINIMAX_M2_ROUTING,
    MINIMAX_M3_ROUTING,
    QWEN3_5_MOE_ROUTING,
    QWEN_MOE_ROUTING,
    deepseek_mapper,
    deepseek_moe_block,
    deepseek_v4_block,
    deepseek_v4_mapper,
    deepseek_v4_refusal,
    gpt_oss_block,
    minimax_m3_block,
    minimax_m3_ffn_name,
    minimax_m3_mapper,
    minimax_m3_mlp,
    minimax_m3_refusal,
)
from vllm.afd.models.shortcut_moe import (
    EXCHANGES_PER_LAYER,
    longcat_flash_mapper,
    shortcut_moe_layer,
)
from vllm.afd.models.spec import (
    MODELS,
    AFDModelSpec,
    dense_mlp,
    mapper_of,
    moe_block,
    moe_ffn,
    token_id_columns,
    under,
)
from vllm.distributed.afd_transfer.afd_connector.base import ExchangeShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_DEEPSEEK_SPEC = AFDModelSpec(
    moe_ffn(
        deepseek_moe_block,
        dense_mlp(f"{MODELS}.deepseek_v2", "DeepseekV2MLP"),
        DEEPSEEK_ROUTING,
    ),
    deepseek_mapper,
    DEEPSEEK_ROUTING,
)

# MiniMax-M3: its own model (``vllm/models/minimax_m3``, CUDA only); dense
# layers name their FFN ``mlp``, MoE layers ``block_sparse_moe``. Sparse
# attention and its indexer stay on the attention side.
_MINIMAX_M3_SPEC = AFDModelSpec(
    moe_ffn(minimax_m3_block, minimax_m3_mlp, MINIMAX_M3_ROUTING),
    minimax_m3_mapper,
    MINIMAX_M3_ROUTING,
    ffn_name=minimax_m3_ffn_name,
    refusal=minimax_m3_refusal,
)

SUPPORTED_ARCHITECTURES: dict[str, AFDModelSpec] = {
    "Qwen3ForCausalLM": AFDModelSpec(
        dense_mlp(f"{MODELS}.qwen2", "Qwen2MLP"),
        mapper_of(f"{MODELS}.qwen2", "Qwen2Model"),
    ),
    "LlamaForCausalLM": AFDModelSpec(
        dense_mlp(f"{MODELS}.llama", "LlamaMLP", bias="mlp_bias"),
        mapper_of(f"{MODELS}.llama", "LlamaModel"),
    ),
    "Qwen3MoeForCausalLM": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.qwen3_moe", "Qwen3MoeSparseMoeBlock"),
            dense_mlp(f"{MODELS}.qwen3_moe", "Qwen3MoeMLP"),
            QWEN_MOE_ROUTING,
        ),
        mapper_of(f"{MODELS}.qwen3_moe", "Qwen3MoeModel"),
        QWEN_MOE_ROUTING,
    ),
    # Qwen3-Next: Qwen2-MoE's gated shared expert and routing behind hybrid
    # linear (gated delta net) and full attention, which stay on the
    # attention side with their state.
    "Qwen3NextForCausalLM": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.qwen3_next", "Qwen3NextSparseMoeBlock"),
            dense_mlp(f"{MODELS}.qwen2_moe", "Qwen2MoeMLP"),
            QWEN_MOE_ROUTING,
        ),
        mapper_of(f"{MODELS}.qwen3_next", "Qwen3NextModel"),
        QWEN_MOE_ROUTING,
    ),
    # Qwen3.5-MoE: Qwen3-Next's layers and MoE block (every layer) as the
    # language model of a vision-language model; the vision tower stays on
    # the attention side, the FFN side reads the layers under
    # ``model.language_model.``.
    "Qwen3_5MoeForConditionalGeneration": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.qwen3_next", "Qwen3NextSparseMoeBlock"), None, QWEN3_5_MOE_ROUTING
        ),
        mapper_of(f"{MODELS}.qwen3_5", "Qwen3_5Model", layers_parent="model.language_model."),
        QWEN3_5_MOE_ROUTING,
    ),
    "Qwen2MoeForCausalLM": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.qwen2_moe", "Qwen2MoeSparseMoeBlock", with_vllm_config=False),
            dense_mlp(f"{MODELS}.qwen2_moe", "Qwen2MoeMLP"),
            QWEN_MOE_ROUTING,
        ),
        mapper_of(f"{MODELS}.qwen2_moe", "Qwen2MoeForCausalLM"),
        QWEN_MOE_ROUTING,
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
        weights_mapper=under(("language_model.model.",), deepseek_mapper),
    ),
    # DeepSeek-V4: its own model (``vllm/models/deepseek_v4``), every layer
    # a MoE block named ``ffn``; the first ``num_hash_layers`` route by token
    # id, so the rows carry it. Hyper-connections, sparse attention and its
    # compressor stay on the attention side; the FFN side is handed the
    # block's input as the layer computes it.
    "DeepseekV4ForCausalLM": AFDModelSpec(
        moe_ffn(deepseek_v4_block, None, DEEPSEEK_V4_ROUTING),
        deepseek_v4_mapper,
        DEEPSEEK_V4_ROUTING,
        ffn_name="ffn",
        routes_by_token_id=True,
        refusal=deepseek_v4_refusal,
    ),
    "Glm4MoeForCausalLM": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.glm4_moe", "Glm4MoE", with_vllm_config=False),
            dense_mlp(f"{MODELS}.glm4_moe", "Glm4MoeMLP"),
            GLM4_MOE_ROUTING,
        ),
        mapper_of(f"{MODELS}.glm4_moe", "Glm4MoeModel"),
        GLM4_MOE_ROUTING,
    ),
    "MiniMaxM2ForCausalLM": AFDModelSpec(
        moe_ffn(
            moe_block(f"{MODELS}.minimax_m2", "MiniMaxM2MoE", with_vllm_config=False),
            None,
            MINIMAX_M2_ROUTING,
        ),
        mapper_of(f"{MODELS}.minimax_m2", "MiniMaxM2Model"),
        MINIMAX_M2_ROUTING,
        ffn_name="block_sparse_moe",
    ),
    "MiniMaxM3SparseForCausalLM": _MINIMAX_M3_SPEC,
    # The vision-language model: the text model's decoder layers under
    # ``language_model.model.``; the vision tower and its projectors stay on
    # the attention side.
    "MiniMaxM3SparseForConditionalGeneration": dataclasses.replace(
        _MINIMAX_M3_SPEC,
        weights_mapper=under(("language_model.model.",), minimax_m3_mapper),
    ),
    # LongCat-Flash: two attentions per decoder layer, each followed by a
    # dense MLP, and a MoE block on a shortcut between them; all three run on
    # the FFN side, in two exchanges per layer (``shortcut_moe``). Its
    # router, with zero-compute experts, runs with the experts.
    "LongcatFlashForCausalLM": AFDModelSpec(
        shortcut_moe_layer,
        longcat_flash_mapper,
        ffn_name=None,
        exchanges_per_layer=EXCHANGES_PER_LAYER,
        num_decoder_layers=lambda model: model.hf_config.num_layers,
    ),
    # gpt-oss: every layer a MoE block whose router has a bias and whose
    # experts have biases and the clamped SwiGLU; attention sinks and sliding
    # windows stay on the attention side.
    "GptOssForCausalLM": AFDModelSpec(
        moe_ffn(gpt_oss_block, None, GPT_OSS_ROUTING),
        mapper_of(f"{MODELS}.gpt_oss", "GptOssForCausalLM"),
        GPT_OSS_ROUTING,
        upstream_loader=lambda: importlib.import_module(f"{MODELS}.gpt_oss").GptOssModel,
    ),
}


def ffn_input_width(vllm_config: VllmConfig) -> int:
    """Columns of the rows the attention side sends: the hidden size, plus
    the router logits when the gate runs on the attention side, plus the
    token id where the model routes by it."""
    model = vllm_config.model_config
    spec = get_afd_model_spec(model.architecture)
    width = model.get_hidden_size()
    if vllm_config.afd_config.compute_gate_on_attention:
        width += spec.routing.router_logit_columns(model.hf_text_config, model.dtype)
    if spec.routes_by_token_id:
        width += token_id_columns(model.dtype)
    return width


def ffn_exchange_shape(vllm_config: VllmConfig) -> ExchangeShape:
    """The rows' width and the exchanges per forward, as both roles' data
    planes and handshakes take them."""
    model = vllm_config.model_config
    spec = get_afd_model_spec(model.architecture)
    return ExchangeShape(
        input_width=ffn_input_width(vllm_config),
        num_layers=spec.exchanges_per_layer * spec.num_decoder_layers(model),
    )


def get_afd_model_spec(architecture: str) -> AFDModelSpec:
    try:
        return SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"AFD does not support the architecture {architecture!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        ) from None
