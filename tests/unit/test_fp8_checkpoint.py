"""vllm_afd_dev.models.fp8_checkpoint: DeepSeek-V3's FP8 block form of a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_afd_dev.models.fp8_checkpoint import (
    dequantize_weight,
    ensure_fp8_checkpoint,
    is_quantized,
    quantize_weight,
    scale_inv_shape,
)


@pytest.mark.parametrize("shape", [(256, 768), (576, 256), (8, 256), (130, 70), (1, 1)])
def test_blocks_round_trip(shape):
    """Per 128x128 block (partial at the right and bottom edges): scale =
    amax / 448, weight = fp8 * scale within e4m3's rounding."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_inv_shape(shape)
    assert scale_inv_shape(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    blocks = torch.zeros(scale.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blocks[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
    torch.testing.assert_close(scale, blocks / 448)
    # e4m3 has 3 mantissa bits: relative rounding error at most 2^-4.
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    err = (dequantize_weight(q, scale) - w).abs()
    assert (err <= w.abs() / 16 + full * 2**-9).all()
    assert q.float().abs().max() <= 448


def test_zero_block_keeps_a_finite_scale():
    q, scale = quantize_weight(torch.zeros(200, 100))
    assert torch.equal(scale, torch.ones(2, 1)) and not q.float().any()


def test_which_tensors_are_quantized():
    assert is_quantized("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 2)
    assert is_quantized("model.layers.0.mlp.experts.3.down_proj.weight", 2)
    assert is_quantized("model.layers.0.mlp.shared_experts.up_proj.weight", 2)
    assert not is_quantized("model.layers.0.mlp.gate.weight", 2)
    assert not is_quantized("model.layers.0.mlp.shared_expert_gate.weight", 2)
    assert not is_quantized("model.layers.0.input_layernorm.weight", 1)
    assert not is_quantized("model.layers.0.mlp.gate.e_score_correction_bias", 1)
    assert not is_quantized("model.embed_tokens.weight", 2)
    assert not is_quantized("lm_head.weight", 2)


def test_checkpoint(tiny_deepseek_v2, tmp_path):
    out = ensure_fp8_checkpoint(tiny_deepseek_v2, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    src, dst = (
        load_file(tiny_deepseek_v2 / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    for name, w in src.items():
        if is_quantized(name, w.ndim):
            assert dst[name].dtype == torch.float8_e4m3fn
            scale = dst[f"{name}_scale_inv"]
            torch.testing.assert_close(
                dequantize_weight(dst[name], scale), w, atol=scale.max().item(), rtol=1 / 16
            )
        else:
            assert dst[name].dtype == torch.bfloat16
            assert torch.equal(dst[name], w.to(torch.bfloat16))
    assert len(dst) == len(src) + sum(is_quantized(n, w.ndim) for n, w in src.items())
    assert ensure_fp8_checkpoint(tiny_deepseek_v2, out) == out  # stamped: not rewritten


def test_deepseek_v4_checkpoint_takes_its_released_fp8_form(tiny_deepseek_v4, tmp_path):
    """DeepSeek-V4 in its FP8 form with FP8 experts (DeepSeek-V4-Flash-Base's):
    every linear layer's weight of the decoder and MTP layers in FP8 with a
    float32 ``<layer>.scale``, the router gates, compressors and indexer
    head weights in bfloat16, the float32 tensors (hyper-connection mixers,
    sinks, correction biases) and the token-id tables as they were, and
    ``expert_dtype: fp8`` beside the quantization config."""
    out = ensure_fp8_checkpoint(tiny_deepseek_v4, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["expert_dtype"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    src, dst = (
        load_file(tiny_deepseek_v4 / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    quantized = [n for n, w in src.items() if is_quantized(n, w.ndim)]
    for name in ("layers.0.attn.wo_a.weight", "layers.1.ffn.experts.3.w2.weight",
                 "layers.2.ffn.shared_experts.w1.weight", "mtp.0.e_proj.weight"):  # fmt: skip
        assert name in quantized, name
        assert dst[name].dtype == torch.float8_e4m3fn
        scale = dst[name.removesuffix(".weight") + ".scale"]
        assert scale.dtype == torch.float32
        torch.testing.assert_close(dequantize_weight(dst[name], scale), src[name].float(),
                                   atol=scale.max().item(), rtol=1 / 16)  # fmt: skip
    kept = ("layers.0.ffn.gate.weight", "layers.1.attn.compressor.wkv.weight",
            "layers.1.attn.indexer.weights_proj.weight", "layers.1.hc_ffn_fn",
            "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "embed.weight")  # fmt: skip
    for name in kept:
        assert name not in quantized, name
        assert dst[name].dtype == src[name].dtype and torch.equal(dst[name], src[name]), name
    assert len(dst) == len(src) + len(quantized)
