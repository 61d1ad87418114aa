"""Generate the project's built-in tiny models: random weights, own tokenizer.

    python scripts/make_tiny_model.py --arch qwen3 --out .cache/models/tiny-qwen3
    python -m vllm_afd_dev.models.tiny_model ...     # the same

Each checkpoint is small but numerically realistic: every matrix is drawn from
N(0, 0.05^2) with a fixed seed, norm weights are 1 and the output head is not
tied to the embedding. vLLM's dummy weights (+-1e-3, identical for every
parameter of one shape) leave the MLP's output far below the residual's
resolution, and a tied head on a tiny random model just repeats its input, so
neither can show a broken FFN. Here zeroing one layer's MLP changes the
greedy tokens, which is what the equivalence tests rely on.

The tokenizer is a byte-level BPE trained on a built-in text, so any prompt
encodes and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import re
from pathlib import Path

# 2 layers, hidden 256: small enough for CPU CI, wide enough that attention
# and MLP both matter. Everything not given is the transformers default.
DENSE_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
# DeepSeek's MoE layout (DeepSeek-V2, V3, GLM-4.5): a dense first layer, then
# MoE with a shared expert and grouped top-k routing (4 groups of 2 experts, 2
# groups kept).
DEEPSEEK_MOE = dict(
    intermediate_size=768,
    moe_intermediate_size=128,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)
# DeepSeek-V3's routing (GLM-4.5's too): sigmoid scores, a correction bias
# for the top-k choice (noaux_tc), normalised top-k weights scaled by a
# factor; plus one multi-token-prediction layer (stored as layer 2, as the
# real checkpoints store theirs; stock vLLM's main model ignores it).
SIGMOID_ROUTING = dict(
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)
ARCHITECTURES: dict[str, dict] = {
    "qwen3": dict(
        DENSE_SHAPE,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        intermediate_size=768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    ),
    "llama": dict(
        DENSE_SHAPE,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        intermediate_size=704,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    ),  # 8 experts, 2 per token: enough that routing matters, small enough for CPU.
    "qwen3_moe": dict(
        DENSE_SHAPE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=768,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    ),
    # Routed experts plus a gated shared expert.
    "qwen2_moe": dict(
        DENSE_SHAPE,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=768,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    ),
    "deepseek_v2": dict(
        DENSE_SHAPE,
        **DEEPSEEK_MOE,
        num_key_value_heads=4,
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        moe_layer_freq=1,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        scoring_func="softmax",
        # DeepSeek's own MLA head dimensions: vLLM's GPU MLA kernels take
        # only a few shapes.
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    ),
}
ARCHITECTURES["deepseek_v3"] = dict(
    ARCHITECTURES["deepseek_v2"],
    **SIGMOID_ROUTING,
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    q_lora_rank=128,
)
# DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention, an indexer (its
# own projections, norm and key cache) in each layer's attention; the FFN is
# V3's. The indexer's sizes are the real ones (the GPU kernels are built for
# them): 64 heads of 128, the 2048 top tokens (all of a tiny model's).
ARCHITECTURES["deepseek_v32"] = dict(
    ARCHITECTURES["deepseek_v3"],
    model_type="deepseek_v32",
    architectures=["DeepseekV32ForCausalLM"],
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=64,
)
# GLM-4.5's: DeepSeek-V3's MoE over standard attention with partial rotary
# embeddings, qk-norm and qkv biases.
ARCHITECTURES["glm4_moe"] = dict(
    DENSE_SHAPE,
    **DEEPSEEK_MOE,
    **SIGMOID_ROUTING,
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    use_qk_norm=True,
    attention_bias=True,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
)

# Qwen3-Next: a gated-delta-net linear-attention layer, then a full-attention
# one, each followed by Qwen2-MoE's routed experts and gated shared expert.
ARCHITECTURES["qwen3_next"] = dict(
    ARCHITECTURES["qwen2_moe"],
    model_type="qwen3_next",
    architectures=["Qwen3NextForCausalLM"],
    layer_types=["linear_attention", "full_attention"],
    norm_topk_prob=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={
        "rope_theta": 10000000.0,
        "rope_type": "default",
        "partial_rotary_factor": 0.25,
    },
)
# Qwen3.5-MoE: Qwen3-Next's layers (here with the gated delta net's input
# projections stored apart) and MoE on every layer, as the language model of
# a vision-language model: a vision tower (2 blocks of width 64 here), mrope
# positions, and one multi-token-prediction layer (``mtp.*``), as the
# released checkpoints have.
ARCHITECTURES["qwen3_5_moe"] = dict(
    model_type="qwen3_5_moe",
    architectures=["Qwen3_5MoeForConditionalGeneration"],
    text_config=dict(
        DENSE_SHAPE,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_theta": 10000000.0,
            "rope_type": "default",
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],  # of the 8 rotary frequencies
        },
    ),
    vision_config=dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=DENSE_SHAPE["hidden_size"],
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
    ),
)
# GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's layers (MLA with the sparse-attention
# indexer) with GLM's sizes and routing: one expert group, sigmoid scores
# with a correction bias, a float32 router (vLLM's, for every GLM-5 config),
# 256-wide value heads, and one multi-token-prediction layer. The indexer's
# sizes are the real ones (32 heads of 128, the 2048 top tokens).
ARCHITECTURES["glm_moe_dsa"] = dict(
    DENSE_SHAPE,
    **DEEPSEEK_MOE,
    **SIGMOID_ROUTING,
    num_key_value_heads=4,
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=32,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
)
ARCHITECTURES["glm_moe_dsa"].update(n_group=1, topk_group=1)
# Kimi-K2.5: DeepSeek-V3's language model (MLA, sigmoid routing with a
# correction bias, a dense first layer) as the language model of a
# vision-language model, in the released checkpoints' layout: decoder layers
# under ``language_model.model.``, the head at ``language_model.lm_head``, a
# MoonViT vision tower (``vision_tower.*``, 2 blocks of width 64 here) and its
# patch-merger projector (``mm_projector.*``). As Kimi-K2's, one expert group
# and no multi-token-prediction layer.
ARCHITECTURES["kimi_k25"] = dict(
    model_type="kimi_k25",
    architectures=["KimiK25ForConditionalGeneration"],
    text_config=dict(
        {k: v for k, v in ARCHITECTURES["deepseek_v3"].items() if k != "architectures"},
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
    ),
    vision_config=dict(
        patch_size=14,
        init_pos_emb_height=64,
        init_pos_emb_width=64,
        init_pos_emb_time=4,
        pos_emb_type="divided_fixed",
        num_attention_heads=2,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        merge_kernel_size=[2, 2],
        video_attn_type="spatial_temporal",
        merge_type="sd2_tpool",
        mm_projector_type="patchmerger",
        projector_hidden_act="gelu",
        projector_ln_eps=1e-5,
    ),
)
# gpt-oss: alternating sliding-window (here 16 tokens, so the prompts pass
# it) and full attention with per-head sinks, each layer a MoE block whose
# router has a bias and whose experts have biases and the clamped SwiGLU.
ARCHITECTURES["gpt_oss"] = dict(
    DENSE_SHAPE,
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    intermediate_size=128,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_theta": 150000.0,
        "rope_type": "yarn",
        "factor": 32.0,  # gpt-oss's, over the tiny context
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
)
# MiniMax-M2: every layer a MoE block (``block_sparse_moe``) with sigmoid
# scores and a correction bias on the block, a float32 router, experts
# stored one by one (w1, w2, w3); attention with qk-norm over all heads and
# partial rotary embeddings.
ARCHITECTURES["minimax_m2"] = dict(
    DENSE_SHAPE,
    model_type="minimax_m2",
    architectures=["MiniMaxM2ForCausalLM"],
    intermediate_size=128,
    num_local_experts=8,
    num_experts_per_tok=2,
    scoring_func="sigmoid",
    use_routing_bias=True,
    use_qk_norm=True,
    qk_norm_type="per_layer",
    rotary_dim=32,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 5000000.0, "rope_type": "default"},
)
# LongCat-Flash: each layer is two MLA attentions, each followed by a dense
# MLP, with a MoE block on a shortcut from the first attention's output that
# joins after the second MLP. Its router picks among routed experts and
# zero-compute experts (the identity), sigmoid scores with a correction bias,
# scaled by a factor, as the released checkpoint routes (here 8 routed and 4
# identity experts, 2 per token). transformers names the decoder layers
# ``num_layers`` and counts their attentions as ``num_hidden_layers`` (twice
# as many), the MLPs' width ``ffn_hidden_size`` and the experts'
# ``expert_ffn_hidden_size``; the MLA and router settings are the released
# checkpoint's. Its multi-token-prediction layer is stored apart
# (``model.mtp.*``), as the released checkpoint stores it.
ARCHITECTURES["longcat_flash"] = dict(
    DENSE_SHAPE,
    num_key_value_heads=4,
    model_type="longcat_flash",
    architectures=["LongcatFlashForCausalLM"],
    num_layers=DENSE_SHAPE["num_hidden_layers"],
    num_hidden_layers=2 * DENSE_SHAPE["num_hidden_layers"],
    ffn_hidden_size=768,
    expert_ffn_hidden_size=128,
    n_routed_experts=8,
    zero_expert_num=4,
    zero_expert_type="identity",
    moe_topk=2,
    routed_scaling_factor=6.0,
    router_bias=False,
    router_dtype="float32",
    mla_scale_q_lora=True,
    mla_scale_kv_lora=True,
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 10000000.0, "rope_type": "default"},
)
# DeepSeek-V4 (``deepseek_v4``), in its released checkpoints' own names
# (``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, ``mtp.0.*``; vLLM
# maps them): every layer a MoE block of sqrt-softplus scores, the first
# ``num_hash_layers`` routed by a table of token ids (``ffn.gate.tid2eid``),
# the others with a correction bias (``ffn.gate.bias``); hyper-connections
# (4 residual streams mixed by ``hc_*``); attention over a sliding window
# plus compressed keys, every 4 tokens with an indexer (ratio 4) or every
# 128 (ratio 128); one multi-token-prediction layer. The sizes vLLM's GPU
# kernels fix are the real ones (heads of 512, rope of 64, the indexer's 64
# heads of 128, a window of 128); the hidden size is the smallest the GPU's
# hyper-connection kernels take whole (2048). Written as plain JSON and
# tensors: transformers' own DeepSeek-V4 config drops keys vLLM reads.
ARCHITECTURES["deepseek_v4"] = dict(
    model_type="deepseek_v4",
    architectures=["DeepseekV4ForCausalLM"],
    hidden_size=2048,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=256,
    o_lora_rank=256,
    o_groups=2,
    sliding_window=128,
    compress_ratios=[0, 4, 128, 0],  # per layer, the last for the MTP layer
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    num_hash_layers=1,
    topk_method="noaux_tc",
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    hidden_act="silu",
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=65536,
    num_nextn_predict_layers=1,
)
# MiniMax-M3 (``minimax_m3_vl``, its text model ``MiniMaxM3SparseForCausalLM``):
# a dense first layer (``mlp``), then MoE layers (``block_sparse_moe``: a
# float32 router, sigmoid scores with a correction bias on the block, a
# shared expert, experts stored one by one as w1, w2, w3, the clamped
# SwiGLU); attention with per-head qk-norm and partial rotary embeddings,
# in the MoE layers with the sparse-attention indexer (index_q/index_k
# projections); Gemma norms (1 + weight) everywhere; one
# multi-token-prediction layer (``model.mtp.layers.0``), as the released
# checkpoint has. The sizes vLLM's GPU kernels fix are the real ones (heads
# and index heads of 128, blocks of 128 tokens, 16 of them kept, as many
# index heads as key-value heads). Written as plain JSON and tensors, in
# vLLM's config schema: transformers' own MiniMax-M3 config writes other
# keys (and 5.17 renames a dense layer's ``mlp`` on save).
MINIMAX_M3_LAYERS = 3
ARCHITECTURES["minimax_m3"] = dict(
    model_type="minimax_m3_vl",
    architectures=["MiniMaxM3SparseForCausalLM"],
    text_config=dict(
        DENSE_SHAPE,
        num_hidden_layers=MINIMAX_M3_LAYERS,
        head_dim=128,
        intermediate_size=128,
        dense_intermediate_size=768,
        shared_intermediate_size=128,
        n_shared_experts=1,
        num_local_experts=8,
        num_experts_per_tok=2,
        scoring_func="sigmoid",
        use_routing_bias=True,
        routed_scaling_factor=2.0,
        moe_layer_freq=[0] + [1] * (MINIMAX_M3_LAYERS - 1),
        hidden_act="swigluoai",
        swiglu_alpha=1.702,
        swiglu_beta=1.0,
        swiglu_limit=7.0,
        use_qk_norm=True,
        qk_norm_type="per_head",
        use_gemma_norm=True,
        attention_output_gate=False,
        rope_theta=5000000.0,
        rotary_dim=64,
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-6,
        num_mtp_modules=1,
        sparse_attention_config=dict(
            use_sparse_attention=True,
            sparse_index_dim=128,
            sparse_num_index_heads=DENSE_SHAPE["num_key_value_heads"],
            sparse_topk_blocks=16,
            sparse_block_size=128,
            sparse_disable_index_value=[0] + [1] * (MINIMAX_M3_LAYERS - 1),
            sparse_score_type="max",
            sparse_init_block=0,
            sparse_local_block=1,
            sparse_attention_freq=[0] + [1] * (MINIMAX_M3_LAYERS - 1),
        ),
    ),
)
RANDOM_VECTORS = {"gpt_oss": ("mlp.router.bias", "self_attn.sinks")}
"""1-D parameters that are drawn at random like matrices, not set to their
identity, so that they matter: gpt-oss's router bias and attention sinks."""
ZERO_CENTRED_NORMS = {
    "qwen3_next": ("linear_attn.norm",),
    "qwen3_5_moe": ("linear_attn.norm", "model.visual."),
}
"""Architectures whose RMSNorms scale by (1 + weight), as Gemma's: those
norms start at 0; the value names the norms that scale by their weight
(the gated delta net's, a vision tower's LayerNorms)."""


def norm_identity(arch: str, name: str) -> float:
    """What 1-D tensor ``name`` starts at unless it is drawn at random: 1 for
    a norm's scale, 0 for a norm that scales by (1 + weight) and for biases
    (a LayerNorm's too)."""
    if "norm" not in name or name.endswith(".bias"):
        return 0.0
    plain = ZERO_CENTRED_NORMS.get(arch)
    return 1.0 if plain is None or any(part in name for part in plain) else 0.0


WEIGHT_STD = 0.05
BIAS_STD = 0.1
"""Spread of the routers' correction biases (``e_score_correction_bias``):
non-zero, large enough to change which experts a token picks."""
SEED = 1234
# `vllm bench` draws random prompt ids below 10000, so the vocabulary must
# reach that far; real ones are larger still.
VOCAB_TARGET = 10240

# Training text for the tokenizer: plain English about the things this
# project moves around, plus a generated pseudo-language (below) with enough
# distinct words for a vocabulary of VOCAB_TARGET merges.
ENGLISH = """
The attention side runs the scheduler, the key value cache and the sampler.
The feed forward side runs the multilayer perceptron of every decoder layer.
Each forward step starts with a small control message and then, for every
layer, hidden states travel one way and the result travels back. A batch may
mix the prefill of a long prompt with the decode of many short ones. Greedy
decoding picks the most likely next token, so two correct runs agree token for
token. Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 128 256 1024 appear in logs.
The quick brown fox jumps over the lazy dog while the model writes a story
about rivers, mountains, cities, machines, music, weather and time.
"""


def corpus(seed: int = SEED, words: int = 400_000) -> list[str]:
    """English lines plus Zipf-distributed words made of random syllables."""
    import random

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(30_000)})
    rng.shuffle(lexicon)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    text = rng.choices(lexicon, weights=weights, k=words)
    lines = [" ".join(text[i : i + 16]) + "." for i in range(0, words, 16)]
    return ENGLISH.strip().splitlines() * 20 + lines


def build_tokenizer(out: Path, extra_special: tuple[str, ...] = ()) -> int:
    """Train and save the byte-level BPE tokenizer, with ``extra_special``
    tokens past the trained vocabulary; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    # A minimal chat template, so that chat endpoints work too.
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
        "assistant\n{% endif %}"
    )
    if extra_special:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special)})
    fast.save_pretrained(out)
    return len(fast)


VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
"""A Qwen vision-language model's special tokens, by the config key of their
id: its tokenizer has them past the trained vocabulary."""
VISION_PIXELS = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}
"""The image and video frame sizes (in pixels) its processors resize to:
small, so that an image is at most 64 tokens (256 patches of 16 x 16 pixels,
merged 2 x 2)."""


def _vision_processor_files(out: Path, vision: dict) -> None:
    """The image and video processors' configs of a Qwen vision-language
    model (Qwen3.5's, but for ``VISION_PIXELS``), which vLLM reads to size the
    multimodal inputs and their encoder's budget."""
    common = {
        "patch_size": vision.get("patch_size", 16),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "merge_size": vision.get("spatial_merge_size", 2),
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": VISION_PIXELS,
        "processor_class": "Qwen3VLProcessor",
    }
    files = {
        "preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessorFast"},
        "video_preprocessor_config.json": {
            **common,
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def build_model(arch: str, out: Path, seed: int = SEED) -> Path:
    """Write config, safetensors weights and tokenizer for ``arch`` to ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if arch not in ARCHITECTURES:
        raise SystemExit(f"unknown arch {arch!r}; choose from {sorted(ARCHITECTURES)}")
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(ARCHITECTURES[arch])
    written_by_hand = {"deepseek_v4": _build_deepseek_v4, "minimax_m3_vl": _build_minimax_m3}
    if spec["model_type"] in written_by_hand:
        written_by_hand[spec["model_type"]](out, spec, torch.Generator().manual_seed(seed))
        (out / STAMP).write_text(json.dumps(_stamp(arch, seed)) + "\n")
        return out
    kimi = spec["model_type"] == "kimi_k25"
    if kimi:  # its language model is built alone, the rest added at the end
        kimi_spec, spec = spec, dict(spec["text_config"])
    vision = "vision_config" in spec
    vocab = build_tokenizer(
        out, KIMI_MEDIA_TOKENS if kimi else tuple(VISION_TOKENS.values()) if vision else ()
    )
    if vision:  # the vision tokens' ids, last in the vocabulary
        spec.update(zip(VISION_TOKENS, range(vocab - len(VISION_TOKENS), vocab), strict=True))
        _vision_processor_files(out, spec["vision_config"])
    model_type = spec.pop("model_type")
    text_args = dict(
        vocab_size=vocab,
        tie_word_embeddings=False,
        initializer_range=WEIGHT_STD,
        bos_token_id=0,
        eos_token_id=0,
    )
    if "text_config" in spec:  # a vision-language model: these are its language model's
        spec["text_config"] = {**spec["text_config"], **text_args}
        text_args = dict(tie_word_embeddings=False)
    # transformers' own class: vLLM registers its config classes with
    # AutoConfig once it has read a checkpoint of that type in this process,
    # and those do not build transformers' model.
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    config = config_class(dtype="float32", **text_args, **spec)
    # Multi-token-prediction layers follow the decoder layers in the
    # checkpoint; transformers builds none, so their decoder blocks are built
    # as extra layers, each as the last layer is, and the rest is added below.
    text_spec = spec.get("text_config", spec)
    num_layers = text_spec["num_hidden_layers"]
    mtp_layers = text_spec.get("num_nextn_predict_layers") or text_spec.get(
        "mtp_num_hidden_layers", 0
    )
    per_layer = {
        name: list(getattr(config.get_text_config(), name))
        for name in ("layer_types", "mlp_layer_types", "indexer_types")
        if getattr(config.get_text_config(), name, None) is not None
    }
    _set_num_layers(config, num_layers + mtp_layers, per_layer)
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto_class.from_config(config, dtype=torch.float32)
    for each in (config, model.config):
        _set_num_layers(each, num_layers, per_layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        random_vectors = RANDOM_VECTORS.get(arch, ())
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1 and not name.endswith(random_vectors):
                p.fill_(norm_identity(arch, name))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * BIAS_STD)
    model.save_pretrained(out, safe_serialization=True)
    if "mtp_num_hidden_layers" in text_spec:
        _save_as_qwen3_5(out, model, num_layers, mtp_layers, gen)
    elif mtp_layers:
        _add_mtp_heads(out, config, mtp_layers, gen)
    elif model_type == "longcat_flash":
        _state_longcat_flash_decoder_layers(out, config)
        _add_longcat_flash_mtp(out, config, gen)
    if kimi:
        _save_as_kimi_k25(out, kimi_spec, config, gen)
    (out / STAMP).write_text(json.dumps(_stamp(arch, seed)) + "\n")
    return out


def _state_longcat_flash_decoder_layers(out: Path, config) -> None:
    """vLLM 0.26's own LongCat-Flash config class (``FlashConfig``) counts
    the decoder layers in ``num_hidden_layers`` where transformers' config
    holds that field, else in ``num_layers``. transformers 5.25 derives
    ``num_hidden_layers`` (the attentions, twice ``num_layers``) and leaves it
    out of config.json; 5.17, the GPU machine's, keeps it as a field of its
    own, so there config.json states the decoder layers in it, as stock vLLM
    reads them."""
    if "num_hidden_layers" not in vars(config):
        return
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["num_hidden_layers"] = config.num_layers
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _set_num_layers(config, num_layers: int, per_layer: dict[str, list]) -> None:
    """Sets the (text) config's decoder layers to ``num_layers``, its lists of
    per-layer kinds to as many, each layer past those of ``per_layer`` of the
    kind of the last one."""
    text = config.get_text_config()
    text.num_hidden_layers = num_layers
    for name, kinds in per_layer.items():
        setattr(text, name, (kinds + kinds[-1:] * num_layers)[:num_layers])


def _add_mtp_heads(out: Path, config, num_layers: int, gen) -> None:
    """Adds to each multi-token-prediction layer (``model.layers.N`` from
    ``num_hidden_layers`` on, its decoder block already saved) what DeepSeek-V3's
    and GLM-4.5's checkpoints hold beside it: the two input norms, the
    projection of their concatenation, an embedding and a head."""
    import torch
    from safetensors.torch import load_file, save_file

    hidden, vocab = config.hidden_size, config.vocab_size
    weights = load_file(out / "model.safetensors")
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + num_layers):
        prefix = f"model.layers.{layer}."
        assert any(n.startswith(prefix) for n in weights), f"no decoder block at {prefix}"
        for name in ("enorm", "hnorm", "shared_head.norm"):
            weights[f"{prefix}{name}.weight"] = torch.ones(hidden)
        shapes = {
            "eh_proj": (hidden, 2 * hidden),
            "embed_tokens": (vocab, hidden),
            "shared_head.head": (vocab, hidden),
        }
        for name, shape in shapes.items():
            weights[f"{prefix}{name}.weight"] = torch.randn(shape, generator=gen) * WEIGHT_STD
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def _add_longcat_flash_mtp(out: Path, config, gen) -> None:
    """Adds LongCat-Flash's multi-token-prediction layer as its released
    checkpoint stores it, apart under ``model.mtp.``: one attention and one
    dense MLP shaped as a decoder layer's first ones, the two input norms,
    the projection of their concatenation, an embedding and a final norm.
    Drops the zero-compute experts' weights, which the released checkpoint
    does not hold and vLLM's loader refuses (``KeyError``): transformers
    5.17, the GPU machine's, builds those experts as MLPs; 5.25 does not."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(out / "model.safetensors")
    zero_experts = re.compile(r"\.mlp\.experts\.(\d+)\.")
    for name in list(weights):
        if (m := zero_experts.search(name)) and int(m.group(1)) >= config.n_routed_experts:
            del weights[name]
    first = "model.layers.0."
    mtp = "model.mtp.layers.0."
    shapes = {
        f"{mtp}self_attn.{name}": weights[f"{first}self_attn.0.{name}"].shape
        for name in ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                     "kv_b_proj.weight", "o_proj.weight")
    }  # fmt: skip
    shapes.update(
        {
            f"{mtp}transformer_layer.mlp.{name}": weights[f"{first}mlps.0.{name}"].shape
            for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        }
    )
    hidden = weights["model.norm.weight"].shape[0]
    shapes[f"{mtp}eh_proj.weight"] = (hidden, 2 * hidden)
    shapes["model.mtp.embed_tokens.weight"] = weights["model.embed_tokens.weight"].shape
    for name, shape in shapes.items():
        weights[name] = torch.randn(shape, generator=gen) * WEIGHT_STD
    norms = {
        f"{mtp}{name}": weights[f"{first}{source}"].shape
        for name, source in (
            ("enorm.m.weight", "input_layernorm.0.weight"),
            ("hnorm.m.weight", "input_layernorm.0.weight"),
            ("input_layernorm.weight", "input_layernorm.0.weight"),
            ("post_attention_layernorm.weight", "post_attention_layernorm.0.weight"),
            ("self_attn.q_a_layernorm.weight", "self_attn.0.q_a_layernorm.weight"),
            ("self_attn.kv_a_layernorm.weight", "self_attn.0.kv_a_layernorm.weight"),
        )
    }
    norms["model.mtp.norm.weight"] = weights["model.norm.weight"].shape
    for name, shape in norms.items():
        weights[name] = torch.ones(shape)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def _save_as_qwen3_5(out: Path, model, num_layers: int, mtp_layers: int, gen) -> None:
    """Rewrites the weights as Qwen3.5-MoE's released checkpoints hold them:
    each decoder layer's routed experts as the model's two 3-D tensors
    (``experts.gate_up_proj``, gate rows first, and ``experts.down_proj``),
    which transformers' save splits into one tensor per expert; and the
    multi-token-prediction layers under ``mtp.``: the decoder blocks built
    past the last layer, their experts one by one as those checkpoints store
    them, with the block's norms and the projection ``fc`` of [embedding |
    hidden state]."""
    import torch
    from safetensors.torch import save_file

    weights = {name: t.contiguous() for name, t in model.state_dict().items()}
    hidden = model.config.get_text_config().hidden_size
    for k in range(mtp_layers):
        src, dst = f"model.language_model.layers.{num_layers + k}.", f"mtp.layers.{k}."
        for name in [n for n in weights if n.startswith(src)]:
            tensor, part = weights.pop(name), name.removeprefix(src)
            if part == "mlp.experts.gate_up_proj":
                for expert, w in enumerate(tensor):
                    gate, up = w.chunk(2)
                    weights[f"{dst}mlp.experts.{expert}.gate_proj.weight"] = gate.clone()
                    weights[f"{dst}mlp.experts.{expert}.up_proj.weight"] = up.clone()
            elif part == "mlp.experts.down_proj":
                for expert, w in enumerate(tensor):
                    weights[f"{dst}mlp.experts.{expert}.down_proj.weight"] = w.clone()
            else:
                weights[dst + part] = tensor
    if mtp_layers:
        for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
            weights[f"mtp.{name}.weight"] = torch.zeros(hidden)  # (1 + weight) norms
        weights["mtp.fc.weight"] = torch.randn((hidden, 2 * hidden), generator=gen) * WEIGHT_STD
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def _build_deepseek_v4(out: Path, spec: dict, gen) -> None:
    """Writes DeepSeek-V4's config, tokenizer and bfloat16 weights in its
    released checkpoints' names and layouts (``ARCHITECTURES["deepseek_v4"]``);
    its float32 tensors (hyper-connection mixers, attention sinks, the
    compressors' positional biases, correction biases) stay float32."""
    import torch
    from safetensors.torch import save_file

    vocab = build_tokenizer(out)
    c = spec
    hidden, heads, head_dim = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    experts, top_k = c["n_routed_experts"], c["num_experts_per_tok"]
    moe, mix = c["moe_intermediate_size"], (2 + c["hc_mult"]) * c["hc_mult"]
    index_width = c["index_n_heads"] * c["index_head_dim"]
    weights: dict[str, torch.Tensor] = {}

    def matrix(name: str, *shape: int, dtype=torch.bfloat16) -> None:
        weights[name] = (torch.randn(shape, generator=gen) * WEIGHT_STD).to(dtype)

    def ones(name: str, size: int) -> None:
        weights[name] = torch.ones(size, dtype=torch.bfloat16)

    def hyper_connections(prefix: str, names: tuple[str, ...]) -> None:
        for name in names:
            matrix(f"{prefix}hc_{name}_fn", mix, c["hc_mult"] * hidden, dtype=torch.float32)
            matrix(f"{prefix}hc_{name}_base", mix, dtype=torch.float32)
            weights[f"{prefix}hc_{name}_scale"] = torch.ones(3)

    def compressor(prefix: str, width: int, ratio: int) -> None:
        overlap = 2 if ratio == 4 else 1  # ratio-4 compressors overlap their windows
        matrix(f"{prefix}wkv.weight", overlap * width, hidden)
        matrix(f"{prefix}wgate.weight", overlap * width, hidden)
        matrix(f"{prefix}ape", ratio, overlap * width, dtype=torch.float32)
        ones(f"{prefix}norm.weight", width)

    def decoder_layer(prefix: str, layer: int, ratio: int) -> None:
        ones(f"{prefix}attn_norm.weight", hidden)
        ones(f"{prefix}ffn_norm.weight", hidden)
        hyper_connections(prefix, ("attn", "ffn"))
        attn = f"{prefix}attn."
        matrix(f"{attn}wq_a.weight", c["q_lora_rank"], hidden)
        ones(f"{attn}q_norm.weight", c["q_lora_rank"])
        matrix(f"{attn}wq_b.weight", heads * head_dim, c["q_lora_rank"])
        matrix(f"{attn}wkv.weight", head_dim, hidden)
        ones(f"{attn}kv_norm.weight", head_dim)
        groups = c["o_groups"]
        matrix(f"{attn}wo_a.weight", groups * c["o_lora_rank"], heads * head_dim // groups)
        matrix(f"{attn}wo_b.weight", hidden, groups * c["o_lora_rank"])
        matrix(f"{attn}attn_sink", heads, dtype=torch.float32)
        if ratio in (4, 128):
            compressor(f"{attn}compressor.", head_dim, ratio)
        if ratio == 4:
            matrix(f"{attn}indexer.wq_b.weight", index_width, c["q_lora_rank"])
            matrix(f"{attn}indexer.weights_proj.weight", c["index_n_heads"], hidden)
            compressor(f"{attn}indexer.compressor.", c["index_head_dim"], ratio)
        ffn = f"{prefix}ffn."
        matrix(f"{ffn}gate.weight", experts, hidden)
        if layer < c["num_hash_layers"]:  # each token's experts: distinct, drawn per id
            draw = torch.rand((vocab, experts), generator=gen)
            weights[f"{ffn}gate.tid2eid"] = draw.argsort(dim=1)[:, :top_k].to(torch.int32)
        else:
            weights[f"{ffn}gate.bias"] = torch.randn(experts, generator=gen) * BIAS_STD
        for expert in range(experts):
            for name, shape in (
                ("w1", (moe, hidden)),
                ("w3", (moe, hidden)),
                ("w2", (hidden, moe)),
            ):
                matrix(f"{ffn}experts.{expert}.{name}.weight", *shape)
        shared = moe * c["n_shared_experts"]
        matrix(f"{ffn}shared_experts.w1.weight", shared, hidden)
        matrix(f"{ffn}shared_experts.w3.weight", shared, hidden)
        matrix(f"{ffn}shared_experts.w2.weight", hidden, shared)

    def head(prefix: str) -> None:
        matrix(f"{prefix}hc_head_fn", c["hc_mult"], c["hc_mult"] * hidden, dtype=torch.float32)
        matrix(f"{prefix}hc_head_base", c["hc_mult"], dtype=torch.float32)
        weights[f"{prefix}hc_head_scale"] = torch.ones(1)

    matrix("embed.weight", vocab, hidden)
    matrix("head.weight", vocab, hidden)
    ones("norm.weight", hidden)
    head("")
    layers = c["num_hidden_layers"]
    for layer in range(layers):
        decoder_layer(f"layers.{layer}.", layer, c["compress_ratios"][layer])
    for k in range(c["num_nextn_predict_layers"]):  # a window-only layer, as vLLM builds it
        mtp = f"mtp.{k}."
        decoder_layer(mtp, layers + k, 0)
        ones(f"{mtp}enorm.weight", hidden)
        ones(f"{mtp}hnorm.weight", hidden)
        ones(f"{mtp}norm.weight", hidden)
        matrix(f"{mtp}e_proj.weight", hidden, hidden)
        matrix(f"{mtp}h_proj.weight", hidden, hidden)
        head(mtp)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = dict(
        spec,
        vocab_size=vocab,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        torch_dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _build_minimax_m3(out: Path, spec: dict, gen) -> None:
    """Writes MiniMax-M3's config (vLLM's schema: ``ARCHITECTURES["minimax_m3"]``),
    tokenizer and bfloat16 weights in its checkpoint's names, the router
    gate and correction bias in float32 as its model keeps them. Its norms
    scale by (1 + weight) and start at 0."""
    import torch
    from safetensors.torch import save_file

    vocab = build_tokenizer(out)
    c = spec["text_config"]
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    sparse = c["sparse_attention_config"]
    experts, moe = c["num_local_experts"], c["intermediate_size"]
    weights: dict[str, torch.Tensor] = {}

    def matrix(name: str, *shape: int, dtype=torch.bfloat16) -> None:
        weights[name] = (torch.randn(shape, generator=gen) * WEIGHT_STD).to(dtype)

    def norm(name: str, size: int) -> None:
        weights[name] = torch.zeros(size, dtype=torch.bfloat16)

    def mlp(prefix: str, width: int) -> None:
        matrix(f"{prefix}gate_proj.weight", width, hidden)
        matrix(f"{prefix}up_proj.weight", width, hidden)
        matrix(f"{prefix}down_proj.weight", hidden, width)

    def decoder_layer(prefix: str, sparse_attention: bool, is_moe: bool) -> None:
        norm(f"{prefix}input_layernorm.weight", hidden)
        norm(f"{prefix}post_attention_layernorm.weight", hidden)
        attn = f"{prefix}self_attn."
        matrix(f"{attn}q_proj.weight", c["num_attention_heads"] * head_dim, hidden)
        matrix(f"{attn}k_proj.weight", c["num_key_value_heads"] * head_dim, hidden)
        matrix(f"{attn}v_proj.weight", c["num_key_value_heads"] * head_dim, hidden)
        matrix(f"{attn}o_proj.weight", hidden, c["num_attention_heads"] * head_dim)
        norm(f"{attn}q_norm.weight", head_dim)
        norm(f"{attn}k_norm.weight", head_dim)
        if sparse_attention:  # index_q per index head, index_k a single head
            index_dim = sparse["sparse_index_dim"]
            matrix(
                f"{attn}index_q_proj.weight", sparse["sparse_num_index_heads"] * index_dim, hidden
            )
            matrix(f"{attn}index_k_proj.weight", index_dim, hidden)
            norm(f"{attn}index_q_norm.weight", index_dim)
            norm(f"{attn}index_k_norm.weight", index_dim)
        if not is_moe:
            mlp(f"{prefix}mlp.", c["dense_intermediate_size"])
            return
        block = f"{prefix}block_sparse_moe."
        matrix(f"{block}gate.weight", experts, hidden, dtype=torch.float32)
        weights[f"{block}e_score_correction_bias"] = torch.randn(experts, generator=gen) * BIAS_STD
        for expert in range(experts):
            matrix(f"{block}experts.{expert}.w1.weight", moe, hidden)
            matrix(f"{block}experts.{expert}.w3.weight", moe, hidden)
            matrix(f"{block}experts.{expert}.w2.weight", hidden, moe)
        mlp(f"{block}shared_experts.", c["shared_intermediate_size"])

    matrix("model.embed_tokens.weight", vocab, hidden)
    matrix("lm_head.weight", vocab, hidden)
    norm("model.norm.weight", hidden)
    for layer in range(c["num_hidden_layers"]):
        decoder_layer(
            f"model.layers.{layer}.",
            sparse["sparse_attention_freq"][layer] != 0,
            c["moe_layer_freq"][layer] != 0,
        )
    for k in range(c["num_mtp_modules"]):  # a sparse-attention MoE layer, as vLLM builds it
        mtp = f"model.mtp.layers.{k}."
        decoder_layer(mtp, sparse_attention=True, is_moe=True)
        for name in ("enorm", "hnorm", "final_layernorm"):
            norm(f"{mtp}{name}.weight", hidden)
        matrix(f"{mtp}eh_proj.weight", hidden, 2 * hidden)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    ids = dict(bos_token_id=0, eos_token_id=0)
    text = dict(c, vocab_size=vocab, tie_word_embeddings=False, **ids)
    config = dict(spec, text_config=text, tie_word_embeddings=False, torch_dtype="bfloat16", **ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


KIMI_MEDIA_TOKENS = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
"""Kimi-K2.5's media tokens, past the trained vocabulary; ``<|media_pad|>``
is the placeholder of each media token (``media_placeholder_token_id``)."""


def _save_as_kimi_k25(out: Path, spec: dict, text_config, gen) -> None:
    """Rewrites a saved DeepSeek-V3 language model as Kimi-K2.5's released
    checkpoints hold it: its tensors under ``language_model.``, a MoonViT
    vision tower and its projector beside it (drawn here, in the names and
    shapes vLLM's ``MoonViT3dPretrainedModel`` loads: fused ``wqkv``,
    ``norm0``/``norm1``, ``mlp.fc0``/``fc1``, a learned (height, width, dim)
    position table), Kimi-K2.5's config and its image processor's config."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    weights = {f"language_model.{n}": w for n, w in load_file(out / "model.safetensors").items()}
    vision = spec["vision_config"]
    width, mlp, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (
            vision["init_pos_emb_height"],
            vision["init_pos_emb_width"],
            width,
        ),
        "vision_tower.encoder.final_layernorm.weight": (width,),
        "vision_tower.encoder.final_layernorm.bias": (width,),
        "mm_projector.pre_norm.weight": (width,),
        "mm_projector.pre_norm.bias": (width,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_config.hidden_size, merged),
        "mm_projector.proj.2.bias": (text_config.hidden_size,),
    }
    for block in range(vision["num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}."
        shapes |= {
            f"{prefix}{name}": shape
            for name, shape in {
                "norm0.weight": (width,),
                "norm0.bias": (width,),
                "norm1.weight": (width,),
                "norm1.bias": (width,),
                "wqkv.weight": (3 * width, width),
                "wqkv.bias": (3 * width,),
                "wo.weight": (width, width),
                "wo.bias": (width,),
                "mlp.fc0.weight": (mlp, width),
                "mlp.fc0.bias": (mlp,),
                "mlp.fc1.weight": (width, mlp),
                "mlp.fc1.bias": (width,),
            }.items()
        }
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = torch.full(shape, norm_identity("kimi_k25", name))
        else:
            weights[name] = torch.randn(shape, generator=gen) * WEIGHT_STD
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})

    media_pad = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|media_pad|>")
    text = text_config.to_dict()
    text.pop("architectures", None)
    config = {
        "architectures": spec["architectures"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k25_vision", **vision},
        "media_placeholder_token_id": media_pad,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    media = {
        "in_patch_limit": 1024,
        "patch_size": patch,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": vision["merge_kernel_size"][0],
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 64,
        "in_patch_limit_each_frame": 1024,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "kimi_k25",
    }
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": media}, indent=2) + "\n"
    )


STAMP = "afd_tiny_model.json"


def _stamp(arch: str, seed: int) -> dict:
    """What a generated checkpoint depends on; a change rebuilds it."""
    return {
        "arch": arch,
        "seed": seed,
        "weight_std": WEIGHT_STD,
        "vocab": VOCAB_TARGET,
        "shape": ARCHITECTURES[arch],
    }


@contextlib.contextmanager
def building(out: Path):
    """Hold a lock on building ``out``: test processes running side by side
    (``pytest -n``) that need the same checkpoint build it once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_model(arch: str, out: Path, seed: int = SEED) -> Path:
    """``out`` if it already holds this model, else build it there."""
    stamp = out / STAMP
    with building(out):
        if stamp.is_file() and json.loads(stamp.read_text()) == _stamp(arch, seed):
            return out
        return build_model(arch, out, seed)


FFN_OUTPUTS = ("down_proj.weight", "experts.down_proj")
"""The names' endings of an FFN's output projections: a dense MLP's or a
shared expert's, each routed expert's, or all routed experts' in one 3-D
tensor (Qwen3.5-MoE's)."""


def with_zeroed_mlp(
    src: Path, dst: Path, layer: int = 0, ending: str | tuple[str, ...] = FFN_OUTPUTS
) -> Path:
    """A copy of checkpoint ``src`` whose layer ``layer`` FFN outputs zero
    (dense MLP, or all routed and shared experts of a MoE block): by default
    its output projections are zero, or the tensors of its FFN whose names
    end with ``ending`` (``e_score_correction_bias``: routing without the
    correction bias).

    The negative control of the equivalence tests: if tokens do not change
    when an FFN is broken, a token comparison proves nothing about the FFN.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    # The dense MLP's, or every expert's and shared expert's, output projection.
    # A vision-language model's decoder layers are under model.language_model.
    # (Qwen3.5's) or language_model.model. (Kimi-K2.5's), DeepSeek-V4's under
    # no parent, its FFN named ffn.
    prefixes = tuple(
        f"{model}layers.{layer}.{ffn}."
        for model in ("model.", "model.language_model.", "language_model.model.", "")
        for ffn in ("mlp", "block_sparse_moe", "ffn")
    )
    names = [n for n in weights if n.startswith(prefixes) and n.endswith(ending)]
    assert names, f"no {ending} in the FFN of layer {layer} of {src}"
    for name in names:
        weights[name] = weights[name].zero_()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def without_tensors(src: Path, dst: Path, prefix: str) -> Path:
    """A copy of checkpoint ``src`` without the tensors whose names start
    with ``prefix``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    kept = {name: w for name, w in weights.items() if not name.startswith(prefix)}
    assert len(kept) < len(weights), f"no tensor of {src} starts with {prefix}"
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def with_num_layers(src: Path, dst: Path, num_layers: int) -> Path:
    """A copy of checkpoint ``src`` cut to its first ``num_layers`` layers: a
    different model with the same shapes, for the mismatched-model tests."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    weights = {
        name: w
        for name, w in load_file(src / "model.safetensors").items()
        if not (m := layer.match(name)) or int(m.group(1)) < num_layers
    }
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(ensure_model(args.arch, args.out, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
