"""The built-in checkpoints have the properties the equivalence tests rely on."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from vllm_afd_dev.models import tiny_model
from vllm_afd_dev.models.tiny_model import (
    ARCHITECTURES,
    BIAS_STD,
    RANDOM_VECTORS,
    VISION_TOKENS,
    WEIGHT_STD,
    ZERO_CENTRED_NORMS,
    build_model,
    ensure_model,
)


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - {"deepseek_v4", "minimax_m3"}))
def test_realistic_random_weights_and_own_tokenizer(arch, models_dir):
    path = ensure_model(arch, models_dir / f"tiny-{arch}")
    config = json.loads((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(path)

    # A vision-language model's language model: its own config and weights' prefix.
    # (Kimi-K2.5's, as released: the whole language model under language_model.)
    text = config.get("text_config", config)
    lm = "model.language_model." if "text_config" in config else "model."
    head = "lm_head.weight"
    if config["model_type"] == "kimi_k25":
        lm, head = "language_model.model.", "language_model.lm_head.weight"
    assert config["architectures"] == ARCHITECTURES[arch]["architectures"]
    assert config["tie_word_embeddings"] is False and text["tie_word_embeddings"] is False
    assert not weights[head].equal(weights[f"{lm}embed_tokens.weight"])
    plain_norms = ZERO_CENTRED_NORMS.get(arch)
    for name, w in weights.items():
        if "norm" in name:
            # the identity: 1, or 0 where a norm scales by (1 + weight); a
            # LayerNorm's bias 0
            scale = plain_norms is None or any(plain in name for plain in plain_norms)
            assert w.eq(1 if scale and not name.endswith(".bias") else 0).all(), name
        elif name.endswith("e_score_correction_bias"):  # random, to matter
            assert w.ndim == 1 and w.std().item() > BIAS_STD / 2, name
        elif name.endswith(RANDOM_VECTORS.get(arch, ())):  # gpt-oss's router bias, sinks
            assert w.ndim == 1 and w.std().item() > WEIGHT_STD / 2, name
        elif w.ndim == 1:  # biases (Qwen2-MoE's attention)
            assert w.eq(0).all(), name
        else:
            # matrices; gpt-oss's stacked experts and Qwen3-Next's convolutions are 3-D
            assert w.ndim >= 2, name
            # large enough for a sample std within 10 % (a shared-expert gate
            # has only hidden_size values)
            if w.numel() >= 4096:
                assert abs(w.std().item() - WEIGHT_STD) < 0.005, name
            else:
                assert w.std().item() > WEIGHT_STD / 2, name

    # every layer has its own FFN values (dummy weights repeat them per shape):
    # the first output projection of each layer (dense MLP or an expert)
    def ffn(i: int) -> tuple[str, str]:
        return f"{lm}layers.{i}.mlp.", f"{lm}layers.{i}.block_sparse_moe."

    downs = [
        weights[min(n for n in weights if n.startswith(ffn(i))
                    and n.endswith(("down_proj.weight", "down_proj", "w2.weight")))]
        for i in range(2)
    ]  # fmt: skip
    assert downs[0].shape != downs[1].shape or not downs[0].equal(downs[1])
    # sigmoid routing comes with a correction bias on every MoE layer; a
    # multi-token-prediction layer follows the decoder layers
    if text.get("topk_method") == "noaux_tc" or config["model_type"] == "glm4_moe":
        assert f"{lm}layers.1.mlp.gate.e_score_correction_bias" in weights
    if config.get("use_routing_bias"):  # MiniMax-M2 keeps it on the block
        assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in weights
    # (Qwen3.5's are stored apart, under mtp., as LongCat-Flash's, whose
    # config counts its decoder layers as num_layers.)
    mtp = f"{lm}layers.{text.get('num_layers', text.get('num_hidden_layers'))}."
    if "mtp_num_hidden_layers" in text:
        mtp = "mtp.layers."
    mtp_layers = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers")
    assert any(n.startswith(mtp) for n in weights) == bool(mtp_layers)
    if config["model_type"] == "longcat_flash":  # its MTP layer, stored apart
        assert weights["model.mtp.layers.0.eh_proj.weight"].shape == (256, 512)
        # two decoder layers, as every transformers release and vLLM's own
        # config class read them (tiny_model._state_longcat_flash_decoder_layers)
        assert config["num_layers"] == 2
        assert config.get("num_hidden_layers", 2) == 2
        assert {n.split(".")[2] for n in weights if n.startswith("model.layers.")} == {"0", "1"}
        assert "model.mtp.layers.0.transformer_layer.mlp.down_proj.weight" in weights
        # the routed experts only: the zero-compute ones have no weights
        experts = {n.split(".")[5] for n in weights if ".mlp.experts." in n}
        assert experts == {str(e) for e in range(config["n_routed_experts"])}
    if config["model_type"] == "qwen3_5_moe":
        # as the released checkpoints: each layer's experts in 3-D tensors,
        # the MTP layer's one by one
        assert weights[f"{lm}layers.1.mlp.experts.gate_up_proj"].shape == (8, 256, 256)
        assert weights[f"{lm}layers.1.mlp.experts.down_proj"].shape == (8, 256, 128)
        assert weights["mtp.layers.0.mlp.experts.7.down_proj.weight"].shape == (256, 128)
    if config["model_type"] == "kimi_k25":  # its tower, projector, processor and tokens
        assert any(n.startswith("vision_tower.encoder.blocks.") for n in weights)
        assert weights["mm_projector.proj.2.weight"].shape[0] == text["hidden_size"]
        assert "media_proc_cfg" in json.loads((path / "preprocessor_config.json").read_text())
        media_pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
        assert media_pad == config["media_placeholder_token_id"] < text["vocab_size"]
    elif "vision_config" in config:  # the tower's weights, processors and tokens
        assert any(n.startswith("model.visual.blocks.") for n in weights)
        assert (path / "preprocessor_config.json").is_file()
        assert (path / "video_preprocessor_config.json").is_file()
        for key, token in VISION_TOKENS.items():
            assert tokenizer.convert_tokens_to_ids(token) == config[key] < text["vocab_size"]
    # vllm bench draws prompt ids below 10000
    assert len(tokenizer) == text["vocab_size"] >= 10000
    sentence = "The attention side runs the scheduler."
    assert tokenizer.decode(tokenizer(sentence)["input_ids"]) == sentence


def test_same_seed_same_checkpoint(tiny_qwen3, tmp_path):
    cached = load_file(tiny_qwen3 / "model.safetensors")
    fresh = load_file(build_model("qwen3", tmp_path / "again") / "model.safetensors")
    assert cached.keys() == fresh.keys()
    assert all(cached[k].equal(fresh[k]) for k in cached)


def test_processes_side_by_side_build_a_checkpoint_once(monkeypatch, tmp_path):
    """``pytest -n`` workers that need the same checkpoint wait for the one
    building it (each call opens the lock file anew, as a process does)."""
    builds = []

    def slow_build(arch, out, seed):
        builds.append(arch)
        time.sleep(0.5)
        out.mkdir(parents=True)
        (out / tiny_model.STAMP).write_text(json.dumps(tiny_model._stamp(arch, seed)))
        return out

    monkeypatch.setattr(tiny_model, "build_model", slow_build)
    out = tmp_path / "tiny-qwen3"
    callers = [threading.Thread(target=ensure_model, args=("qwen3", out)) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert builds == ["qwen3"]


def _archs_vllm_has_its_own_config_for() -> list[str]:
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    return sorted(a for a, spec in ARCHITECTURES.items() if spec["model_type"] in _CONFIG_REGISTRY)


@pytest.mark.parametrize("arch", _archs_vllm_has_its_own_config_for())
def test_builds_after_vllm_registered_its_own_config_class(arch, tmp_path):
    # vLLM registers its own config class with AutoConfig once it has read
    # such a checkpoint in the process (Qwen3.5-MoE's vision config, for one,
    # is not the one transformers' model is built from), so the builder must
    # not go through AutoConfig.
    from vllm.transformers_utils.config import _CONFIG_REGISTRY, _register_config_class

    model_type = ARCHITECTURES[arch]["model_type"]
    _register_config_class(model_type, _CONFIG_REGISTRY[model_type])
    path = build_model(arch, tmp_path / "m", seed=0)
    assert json.loads((path / "config.json").read_text())["model_type"] == model_type


def test_deepseek_v4_in_its_released_names_and_dtypes(tiny_deepseek_v4):
    """DeepSeek-V4's checkpoint as released (no transformers model writes
    it): untied head, identity norms, random matrices, float32 mixers and
    sinks, a token-id table of distinct experts per id on the hash layer and
    a random correction bias on the others, compressors on the compressed
    layers and an indexer on the ratio-4 one, one MTP layer under ``mtp.0.``,
    and the config keys vLLM reads."""
    config = json.loads((tiny_deepseek_v4 / "config.json").read_text())
    weights = load_file(tiny_deepseek_v4 / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(tiny_deepseek_v4)
    spec = ARCHITECTURES["deepseek_v4"]
    for key in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "index_topk"):
        assert config[key] == spec[key], key
    assert config["tie_word_embeddings"] is False
    assert not weights["head.weight"].equal(weights["embed.weight"])
    vocab, experts = config["vocab_size"], config["n_routed_experts"]
    assert len(tokenizer) == vocab >= 10000
    table = weights["layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int32 and table.shape == (vocab, config["num_experts_per_tok"])
    assert table.min() >= 0 and table.max() < experts
    assert (table[:, 0] != table[:, 1]).all()
    assert "layers.0.ffn.gate.bias" not in weights
    for layer in (1, 2):
        bias = weights[f"layers.{layer}.ffn.gate.bias"]
        assert bias.dtype == torch.float32 and bias.std().item() > BIAS_STD / 2
    for name in ("layers.1.hc_attn_fn", "layers.0.attn.attn_sink", "hc_head_fn"):
        assert weights[name].dtype == torch.float32, name
    assert "layers.1.attn.indexer.wq_b.weight" in weights
    assert "layers.2.attn.compressor.ape" in weights
    assert "layers.2.attn.indexer.wq_b.weight" not in weights  # ratio 128: no indexer
    assert "layers.0.attn.compressor.ape" not in weights  # window only
    assert weights["mtp.0.e_proj.weight"].shape == (config["hidden_size"],) * 2
    assert "mtp.0.ffn.experts.0.w2.weight" in weights
    for name, w in weights.items():
        if "norm" in name:
            assert w.eq(1).all(), name
        elif w.ndim == 2 and w.is_floating_point() and w.numel() >= 4096:
            assert abs(w.float().std().item() - WEIGHT_STD) < 0.005, name
    downs = [weights[f"layers.{i}.ffn.experts.0.w2.weight"] for i in range(3)]
    assert not downs[0].equal(downs[1]) and not downs[1].equal(downs[2])
    sentence = "The attention side runs the scheduler."
    assert tokenizer.decode(tokenizer(sentence)["input_ids"]) == sentence


def test_minimax_m3_in_its_checkpoint_names_as_vllm_reads_its_config(tiny_minimax_m3):
    """MiniMax-M3's checkpoint, written by hand in vLLM's config schema (no
    transformers release writes the same one): vLLM's own config class
    reads back the tiny shape; a dense first layer under ``mlp``, MoE layers
    under ``block_sparse_moe`` with a float32 router, a random correction
    bias and experts stored one by one; the indexer's projections on the
    sparse-attention layers only; an untied head; Gemma norms at 0; one MTP
    layer under ``model.mtp.layers.0.``."""
    from vllm.transformers_utils.config import get_config

    spec = ARCHITECTURES["minimax_m3"]["text_config"]
    text = get_config(str(tiny_minimax_m3), trust_remote_code=False).get_text_config()
    assert type(text).__name__ == "MiniMaxM3TextConfig"
    for key in (
        "num_hidden_layers", "hidden_size", "head_dim", "moe_layer_freq", "hidden_act",
        "dense_intermediate_size", "intermediate_size", "n_shared_experts", "num_local_experts",
        "use_routing_bias", "partial_rotary_factor", "sparse_attention_config",
    ):  # fmt: skip
        assert getattr(text, key) == spec[key], key
    assert text.rope_parameters["rope_theta"] == spec["rope_theta"]
    sparse = text.sparse_attention_config
    assert sparse["sparse_num_index_heads"] == text.num_key_value_heads
    assert text.shared_intermediate_size == text.intermediate_size * text.n_shared_experts
    assert text.tie_word_embeddings is False

    weights = load_file(tiny_minimax_m3 / "model.safetensors")
    assert not weights["lm_head.weight"].equal(weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate_proj.weight" in weights
    assert not any(n.startswith("model.layers.0.block_sparse_moe.") for n in weights)
    assert "model.layers.0.self_attn.index_q_proj.weight" not in weights
    for layer in range(1, text.num_hidden_layers):
        block = f"model.layers.{layer}.block_sparse_moe."
        assert not any(n.startswith(f"model.layers.{layer}.mlp.") for n in weights)
        assert weights[f"{block}gate.weight"].dtype == torch.float32
        bias = weights[f"{block}e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.std().item() > BIAS_STD / 2
        for expert in range(text.num_local_experts):
            for w in ("w1", "w2", "w3"):
                assert f"{block}experts.{expert}.{w}.weight" in weights
        assert f"{block}shared_experts.down_proj.weight" in weights
        index_k = weights[f"model.layers.{layer}.self_attn.index_k_proj.weight"]
        assert index_k.shape == (sparse["sparse_index_dim"], text.hidden_size)
    assert weights["model.mtp.layers.0.eh_proj.weight"].shape == (256, 512)
    assert "model.mtp.layers.0.block_sparse_moe.experts.0.w2.weight" in weights
    for name, w in weights.items():
        if "norm" in name:
            assert w.eq(0).all(), name
        elif w.ndim == 2 and w.numel() >= 4096:
            assert abs(w.float().std().item() - WEIGHT_STD) < 0.005, name
    downs = [weights[f"model.layers.{i}.block_sparse_moe.experts.0.w2.weight"] for i in (1, 2)]
    assert not downs[0].equal(downs[1])
