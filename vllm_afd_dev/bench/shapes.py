"""Model shapes the GPU benchmarks time with dummy weights: configs laid over
a tiny checkpoint's (``decode_timing.shaped_model`` in benchmarks/)."""

from __future__ import annotations

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
