"""vllm_afd_dev.models.mxfp4_checkpoint: gpt-oss's MXFP4 experts, checked
against transformers' reader of the published checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from vllm_afd_dev.models.mxfp4_checkpoint import (
    E2M1_VALUES,
    QUANTIZATION_CONFIG,
    dequantize_experts,
    ensure_mxfp4_checkpoint,
    quantize_experts,
)


def test_values_on_the_grid_round_trip_exactly():
    """Each block: E2M1 values times a power of two (the block's largest in
    [4, 8) times its scale), negative ones too, back unchanged."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    codes = torch.randint(0, 16, (3, 64, 96), generator=gen)
    codes[..., 0] = 7  # 6.0 in every block of 32 along the input features
    exponents = torch.randint(-6, 3, (3, 2, 96), generator=gen).float()
    w = grid[codes] * torch.exp2(exponents).repeat_interleave(32, dim=1)
    blocks, scales = quantize_experts(w)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    assert torch.equal(scales.float() - 127, exponents.transpose(1, 2))
    assert torch.equal(dequantize_experts(blocks, scales), w)


@pytest.mark.parametrize("shape", [(8, 256, 256), (8, 128, 256), (2, 32, 1)])
def test_transformers_reads_back_what_was_written(shape):
    """The layout of the published checkpoints: transformers' reader (for
    the ``[experts, in, out]`` bfloat16 layout) gets the same values, each
    within its block's rounding (at most 2 scales: saturation at 6 of a
    block whose largest value is just under 8 scales)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05
    w[0, :32, 0] = 0.0  # an all-zero block
    blocks, scales = quantize_experts(w)
    ours = dequantize_experts(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=2).transpose(1, 2)
    assert ((ours - w).abs() <= 2 * scale).all()
    assert ((ours - w).abs() <= scale / 2).float().mean() > 0.9  # most round, few saturate
    assert torch.equal(ours[0, :32, 0], torch.zeros(32))


def test_a_block_needs_32_input_features():
    with pytest.raises(ValueError, match="input features in blocks of 32"):
        quantize_experts(torch.ones(1, 48, 4))


def test_the_tiny_gpt_oss_in_its_shipped_form(tiny_gpt_oss, tiny_qwen3, tmp_path):
    out = ensure_mxfp4_checkpoint(tiny_gpt_oss, tmp_path / "mxfp4")
    source = {
        k: v for f in sorted(tiny_gpt_oss.glob("*.safetensors")) for k, v in load_file(f).items()
    }
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    experts = config["num_local_experts"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, out_features, in_features in (
            ("gate_up_proj", 2 * intermediate, hidden),
            ("down_proj", hidden, intermediate),
        ):
            blocks, scales = written[prefix + name + "_blocks"], written[prefix + name + "_scales"]
            assert blocks.shape == (experts, out_features, in_features // 32, 16)
            assert scales.shape == (experts, out_features, in_features // 32)
            assert prefix + name not in written
            back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            torch.testing.assert_close(back, source[prefix + name], atol=0.05, rtol=0.25)
        assert written[prefix + "gate_up_proj_bias"].dtype == torch.bfloat16
    assert written["model.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    assert ensure_mxfp4_checkpoint(tiny_gpt_oss, out) == out  # stamped: not rewritten
    with pytest.raises(ValueError, match="MXFP4 experts are gpt-oss's form"):
        ensure_mxfp4_checkpoint(tiny_qwen3, tmp_path / "qwen3")
