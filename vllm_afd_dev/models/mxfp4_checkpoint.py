"""Rewrite a gpt-oss checkpoint with its experts in MXFP4, the form gpt-oss ships in.

    python scripts/mxfp4_checkpoint.py SRC DST
    python -m vllm_afd_dev.models.mxfp4_checkpoint ...     # the same

Each layer's ``mlp.experts.gate_up_proj`` (``[experts, hidden, 2 *
intermediate]``) and ``mlp.experts.down_proj`` (``[experts, intermediate,
hidden]``) become, as in the published checkpoints (OCP MX, blocks of 32
along the input features):

- ``<name>_blocks``: uint8 ``[experts, out, in / 32, 16]``, 32 FP4 (E2M1)
  values per block, two per byte, the first in the low nibble;
- ``<name>_scales``: uint8 ``[experts, out, in / 32]``, each block's scale
  as an E8M0 exponent (``2 ** (byte - 127)``).

Per block the scale is ``2 ** (floor(log2(amax)) - 2)`` (E2M1's largest
value is 6 = 1.5 * 2**2), and each value divided by it rounds to the nearest
E2M1 value, saturating at 6. Everything else is stored in bfloat16:
attention, the router, the experts' biases, embeddings, norms and head.
config.json gains gpt-oss's ``quantization_config`` (``quant_method:
mxfp4``, with the attention, router, embeddings and head not converted).
transformers' ``convert_moe_packed_tensors`` reads the tensors back
(tests/unit/test_mxfp4_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .rewrite import ensure_rewritten, rewrite_checkpoint, source_stamp

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative FP4 (E2M1) values, by code; code | 8 is the negative."""
E2M1_MAX_EXPONENT = 2
"""6 = 1.5 * 2 ** 2: a block's scale puts its largest value in [4, 8)."""
E8M0_BIAS = 127
STAMP = "afd_mxfp4_checkpoint.json"
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantize_experts(w):
    """``(blocks, scales)`` of one experts tensor ``w`` (``[experts, in,
    out]``, the bfloat16 checkpoint's layout)."""
    import torch

    experts, in_features, out_features = w.shape
    if in_features % BLOCK:
        raise ValueError(f"MXFP4 needs input features in blocks of {BLOCK}, got {in_features}")
    rows = w.float().transpose(1, 2).reshape(experts, out_features, in_features // BLOCK, BLOCK)
    amax = rows.abs().amax(dim=-1)
    # An all-zero block (a zeroed FFN of a negative control) keeps scale 1.
    exponent = torch.where(
        amax > 0,
        torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny)))
        - E2M1_MAX_EXPONENT,
        torch.zeros_like(amax),
    ).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = rows / torch.exp2(exponent)[..., None]
    grid = torch.tensor(E2M1_VALUES)
    code = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1).to(torch.uint8)
    code |= (scaled < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_experts(blocks, scales):
    """The float32 ``[experts, in, out]`` tensor that ``blocks`` and
    ``scales`` stand for."""
    import torch

    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    values = torch.stack((grid[(blocks & 0x0F).long()], grid[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.float() - E8M0_BIAS)[..., None]
    experts, out_features = values.shape[:2]
    return values.reshape(experts, out_features, -1).transpose(1, 2).contiguous()


def quantize_checkpoint(src: Path, dst: Path) -> Path:
    """Write gpt-oss checkpoint ``src`` (float32 or bfloat16) to ``dst``
    with its experts in MXFP4."""
    import torch

    def convert(name: str, w) -> dict:
        if _EXPERTS.match(name):
            blocks, scales = quantize_experts(w)
            return {f"{name}_blocks": blocks, f"{name}_scales": scales}
        return {name: w.to(torch.bfloat16) if w.is_floating_point() else w}

    def update_config(config: dict) -> None:
        config["quantization_config"] = QUANTIZATION_CONFIG

    src, dst = Path(src), Path(dst)
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    if model_type != "gpt_oss":
        raise ValueError(f"MXFP4 experts are gpt-oss's form; {src} is a {model_type} model")
    return rewrite_checkpoint(src, dst, convert, update_config, STAMP, _stamp(src))


def _stamp(src: Path) -> dict:
    return {"source": source_stamp(src), "block": BLOCK}


def ensure_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """``dst`` if it already holds ``src`` with MXFP4 experts, else write it."""
    src, dst = Path(src), Path(dst)
    return ensure_rewritten(dst, STAMP, _stamp(src), lambda: quantize_checkpoint(src, dst))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    print(ensure_mxfp4_checkpoint(args.src, args.dst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
