"""The built-in checkpoints have the properties the equivalence tests rely on."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from make_tiny_model import ARCHITECTURES, WEIGHT_STD, build_model, ensure_model


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_realistic_random_weights_and_own_tokenizer(arch, models_dir):
    path = ensure_model(arch, models_dir / f"tiny-{arch}")
    config = json.loads((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(path)

    assert config["architectures"] == ARCHITECTURES[arch]["architectures"]
    assert config["tie_word_embeddings"] is False
    assert not weights["lm_head.weight"].equal(weights["model.embed_tokens.weight"])
    for name, w in weights.items():
        if "norm" in name:
            assert w.eq(1).all(), name
        else:
            assert w.ndim == 2 and abs(w.std().item() - WEIGHT_STD) < 0.005, name
    # every layer has its own MLP values (dummy weights repeat them per shape)
    downs = [weights[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(2)]
    assert not downs[0].equal(downs[1])
    # vllm bench draws prompt ids below 10000
    assert len(tokenizer) == config["vocab_size"] >= 10000
    text = "The attention side runs the scheduler."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_same_seed_same_checkpoint(tiny_qwen3, tmp_path):
    cached = load_file(tiny_qwen3 / "model.safetensors")
    fresh = load_file(build_model("qwen3", tmp_path / "again") / "model.safetensors")
    assert cached.keys() == fresh.keys()
    assert all(cached[k].equal(fresh[k]) for k in cached)
