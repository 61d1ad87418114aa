"""Rewrite a checkpoint with FP8 block-quantized weights, as DeepSeek-V3 ships.

    python scripts/fp8_checkpoint.py SRC DST [--block 128 128]
    python -m vllm_afd_dev.models.fp8_checkpoint ...     # the same

Every linear layer's weight matrix in the decoder layers (attention
projections, dense MLP, routed and shared experts) becomes float8_e4m3fn with a
float32 ``<name>_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]``: per
128x128 block, scale = amax / 448 (448 is e4m3's largest value),
fp8 = w / scale rounded to e4m3, and the stored ``scale_inv`` is that scale
(the dequantized weight is ``fp8 * scale_inv`` block by block; blocks at the
right and bottom edges are partial). Everything else stays unquantized, in
bfloat16: embeddings, norms, the output head, the router gate
(``mlp.gate.weight``), ``e_score_correction_bias`` and Qwen's
``shared_expert_gate``.

A DeepSeek-V4 checkpoint (its own names: ``layers.N.attn.wq_a.weight``,
``mtp.0.*``) gets its released FP8 form instead, the one whose experts are
FP8 too (DeepSeek-V4-Flash-Base): each scale is ``<layer>.scale`` and
config.json says ``expert_dtype: fp8``; its router gates, compressors and
the indexer's head weights stay bfloat16 and its float32 tensors float32,
as released.

config.json gains DeepSeek-V3's ``quantization_config``
(``quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]``). vLLM builds Qwen-MoE's router gate with the
model's quantization config, so for those models the config also lists the
gates in ``modules_to_not_convert``, as Qwen's own FP8 checkpoints do;
DeepSeek's gate is never quantized and its config lists nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from .rewrite import ensure_rewritten, rewrite_checkpoint, source_stamp

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
STAMP = "afd_fp8_checkpoint.json"
_LAYER_MATRIX = re.compile(r"^model\.layers\.\d+\..*\.weight$")
_ROUTER_GATE = re.compile(r"^(model\.layers\.\d+\.mlp\.gate)\.weight$")
_SHARED_EXPERT_GATE = re.compile(r"\.mlp\.shared_expert_gate\.weight$")
_DEEPSEEK_V4_MATRIX = re.compile(r"^(?:layers|mtp)\.\d+\..*\.weight$")
_DEEPSEEK_V4_UNQUANTIZED = re.compile(
    r"\.(?:ffn\.gate|compressor\.wkv|compressor\.wgate|indexer\.weights_proj)\.weight$"
)


def is_quantized(name: str, ndim: int) -> bool:
    """Whether checkpoint tensor ``name`` is stored in FP8 with a scale: the
    matrices of the decoder layers' linear layers, less the routers (and
    DeepSeek-V4's compressors and indexer head weights)."""
    if ndim != 2:
        return False
    if _DEEPSEEK_V4_MATRIX.match(name):
        return not _DEEPSEEK_V4_UNQUANTIZED.search(name)
    return (
        _LAYER_MATRIX.match(name) is not None
        and not _ROUTER_GATE.match(name)
        and not _SHARED_EXPERT_GATE.search(name)
    )


def scale_name(name: str) -> str:
    """The name of weight ``name``'s scale: ``<weight>_scale_inv``, or in
    DeepSeek-V4's names ``<layer>.scale``."""
    if _DEEPSEEK_V4_MATRIX.match(name):
        return f"{name.removesuffix('.weight')}.scale"
    return f"{name}_scale_inv"


def scale_inv_shape(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def quantize_weight(w, block: tuple[int, int] = BLOCK):
    """``(fp8 weight, float32 scale_inv)`` of a 2-D weight, block by block."""
    import torch

    rows, cols = w.shape
    br, bc = block
    nr, nc = scale_inv_shape((rows, cols), block)
    w = w.float()
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block (a zeroed FFN of a negative control) keeps scale 1.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize_weight(q, scale_inv, block: tuple[int, int] = BLOCK):
    """The float32 weight ``q`` and ``scale_inv`` stand for."""
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:rows, :cols]


def quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int] = BLOCK) -> Path:
    """Write ``src`` (a float32 or bf16 safetensors checkpoint, one file or
    several with an index) to ``dst`` in DeepSeek-V3's FP8 block form."""
    import torch

    gates = []
    own_dtypes = json.loads((Path(src) / "config.json").read_text())["model_type"] == "deepseek_v4"

    def convert(name: str, w) -> dict:
        if is_quantized(name, w.ndim):
            q, scale_inv = quantize_weight(w, block)
            return {name: q, scale_name(name): scale_inv}
        if m := _ROUTER_GATE.match(name):
            gates.append(m.group(1))
        if own_dtypes or not w.is_floating_point():
            return {name: w}
        return {name: w.to(torch.bfloat16)}

    def update_config(config: dict) -> None:
        config["quantization_config"] = quantization_config(block)
        if config.get("model_type") == "deepseek_v4":
            config["expert_dtype"] = "fp8"
        if gates and not config.get("model_type", "").startswith("deepseek"):
            config["quantization_config"]["modules_to_not_convert"] = sorted(gates)

    src, dst = Path(src), Path(dst)
    return rewrite_checkpoint(src, dst, convert, update_config, STAMP, _stamp(src, block))


def _stamp(src: Path, block: tuple[int, int]) -> dict:
    return {"source": source_stamp(src), "block": list(block)}


def ensure_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = BLOCK) -> Path:
    """``dst`` if it already holds ``src`` quantized this way, else write it."""
    src, dst = Path(src), Path(dst)
    return ensure_rewritten(
        dst, STAMP, _stamp(src, block), lambda: quantize_checkpoint(src, dst, block)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--block", type=int, nargs=2, default=list(BLOCK))
    args = parser.parse_args()
    print(ensure_fp8_checkpoint(args.src, args.dst, tuple(args.block)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
