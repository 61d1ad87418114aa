# SPDX-License-Identifier: Apache-2.0
"""Model shapes: what the planner needs of a model, read from its Hugging
Face ``config.json``, and the named shapes (the GPU benchmarks' and those of
the published deployments the planner is checked against)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

QWEN3_0_6B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
"""Qwen3-0.6B's shape."""
QWEN3_8B = dict(
    QWEN3_0_6B,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
    dtype="bfloat16",
    layer_types=["full_attention"] * 36,
)
"""Qwen3-8B's shape."""
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_local_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
"""Qwen3-30B-A3B's shape but for its depth, which each benchmark sets."""
QWEN3_30B_A3B_LAYERS = 48
"""Qwen3-30B-A3B's depth."""

FP8 = {"quantization_config": {"quant_method": "fp8"}}
NAMED: dict[str, dict] = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-30b-a3b": dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS),
    "qwen3-235b-a22b": dict(
        QWEN3_30B_A3B,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
    ),
    "deepseek-v3": dict(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=129280,
        **FP8,
    ),
    "minimax-m2.5": dict(
        hidden_size=3072,
        intermediate_size=1536,
        num_local_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=62,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=200064,
        **FP8,
    ),
    # Hybrid: three gated-delta-net layers to each full-attention layer.
    "qwen3.5-122b-a10b": dict(
        hidden_size=3072,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        num_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_num_value_heads=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
    ),
    "mixtral-8x22b": dict(
        hidden_size=6144,
        intermediate_size=16384,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=56,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
    ),
}
"""Named shapes, as the keys of a config.json. ``vllm afd-plan --model``
takes a name or a local config; a named shape is its model's published
config as far as the planner reads it."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads of a model: sizes in parameters and bytes."""

    name: str
    """The shape's name or the config's path."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size: the width of a row exchanged between the roles."""
    vocab: int
    """Vocabulary: the LM head's rows."""
    attention_params: float
    """Weights of every layer's token mixer (attention or linear attention)."""
    kv_bytes_per_token: float
    """KV cache bytes one context token adds, all layers (bf16 cache)."""
    attention_flops_per_context_token: float
    """FLOPs of one decode token's attention over one context token, all layers."""
    state_bytes_per_seq: float
    """A sequence's recurrent state read each step (linear-attention layers)."""
    moe_layers: int
    """Layers whose FFN is a mixture of experts (the rest are dense MLPs)."""
    experts: int
    """Routed experts per MoE layer (0: a dense model)."""
    top_k: int
    """Routed experts per token."""
    expert_params: float
    """Weights of one routed expert."""
    replicated_ffn_params: float
    """FFN weights every token reads, all layers: dense MLPs, shared experts, routers."""
    weight_bytes: float
    """Bytes per weight (1 for FP8 checkpoints, else 2)."""

    @property
    def routed_params(self) -> float:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.hidden

    def touched(self, tokens: float) -> float:
        """Share of a MoE layer's experts that ``tokens`` tokens touch, each
        routed to ``top_k`` of them uniformly."""
        if not self.experts:
            return 1.0
        return 1 - (1 - self.top_k / self.experts) ** tokens

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelShape:
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
        layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or h // heads
        interval = cfg.get("full_attention_interval", 1)
        full = layers // interval
        linear = layers - full
        if "kv_lora_rank" in cfg:  # MLA: the cache holds the latent and the rope key
            q_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
            q_rank = cfg.get("q_lora_rank") or h
            per_layer = (
                h * q_rank
                + q_rank * heads * q_head
                + h * latent
                + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
                + heads * cfg["v_head_dim"] * h
            )
            kv_token = 2 * latent * layers
            # Absorbed decode attention: each head reads the latent twice.
            ctx_flops = 4 * heads * latent * layers
            state = 0.0
        else:
            q, kv = heads * head_dim, kv_heads * head_dim
            per_layer = 2 * h * q + 2 * h * kv
            kv_token = 2 * 2 * kv * full
            ctx_flops = 4 * q * full
            v_heads = cfg.get("linear_num_value_heads", 0)
            k_dim, v_dim = cfg.get("linear_key_head_dim", 0), cfg.get("linear_value_head_dim", 0)
            # A gated delta net's state: per value head a k x v matrix in float32.
            state = 4 * v_heads * k_dim * v_dim * linear
        experts = (
            cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts", 0)
        )
        dense_mlp = 3 * h * cfg.get("intermediate_size", 0)
        if experts:
            expert = 3 * h * (cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            dense_layers = cfg.get("first_k_dense_replace", 0)
            moe_layers = layers - dense_layers
            shared_size = cfg.get("shared_expert_intermediate_size") or (
                cfg.get("n_shared_experts", 0) * cfg.get("moe_intermediate_size", 0)
            )
            shared = 3 * h * shared_size
            replicated = dense_layers * dense_mlp + moe_layers * (shared + h * experts)
            top_k = cfg["num_experts_per_tok"]
        else:
            expert, moe_layers, top_k, replicated = 0.0, 0, 0, layers * dense_mlp
        quant = cfg.get("quantization_config") or {}
        fp8 = (
            quant.get("quant_method") == "fp8" or "fp8" in str(quant.get("quant_algo", "")).lower()
        )
        return cls(
            name=name,
            layers=layers,
            hidden=h,
            vocab=cfg["vocab_size"],
            attention_params=per_layer * layers,
            kv_bytes_per_token=kv_token,
            attention_flops_per_context_token=ctx_flops,
            state_bytes_per_seq=state,
            moe_layers=moe_layers,
            experts=experts,
            top_k=top_k,
            expert_params=expert,
            replicated_ffn_params=replicated,
            weight_bytes=1.0 if fp8 else 2.0,
        )


def load_config(model: str) -> dict:
    """The config of a named shape, or of a local config.json (or a
    directory holding one)."""
    if model in NAMED:
        return dict(NAMED[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{model!r} is neither a named shape ({', '.join(NAMED)}) nor a "
            "local config.json or a directory holding one"
        )
    return json.loads(path.read_text())


def layers_override(cfg: dict, layers: int) -> dict:
    """vLLM's ``hf_overrides`` that cut ``cfg`` to ``layers`` decoder
    layers; a multimodal config nests its language model's."""
    if "text_config" in cfg:
        return {"text_config": {"num_hidden_layers": layers}}
    return {"num_hidden_layers": layers}


def load_shape(model: str, layers: int | None = None) -> ModelShape:
    """A named shape, or a local config.json (or a directory holding one);
    ``layers``: cut to that depth, as a calibration run on one GPU is."""
    cfg = load_config(model)
    if layers is not None:  # as vLLM applies the override: nested configs updated
        for key, value in layers_override(cfg, layers).items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    return ModelShape.from_config(model, cfg)
