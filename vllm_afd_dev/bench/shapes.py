"""Model shapes the GPU benchmarks and the calibration test time with dummy
weights: configs laid over a tiny checkpoint's (``shaped_model``). They are
the planner's named shapes (``vllm afd-plan --model qwen3-8b``), defined
once in vllm.afd.plan.shapes."""

from __future__ import annotations

import json
from pathlib import Path

from vllm.afd.plan.shapes import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS

from vllm_afd_dev.harness.generate import DEFAULT_MODEL

__all__ = ["QWEN3_0_6B", "QWEN3_8B", "QWEN3_30B_A3B", "QWEN3_30B_A3B_LAYERS", "shaped_model"]


def shaped_model(out: Path, config: dict, base: Path = DEFAULT_MODEL) -> Path:
    """A model directory with ``config`` laid over the tiny model ``base``'s
    and its tokenizer; with ``load_format="dummy"`` it needs no weights."""
    out.mkdir(parents=True, exist_ok=True)
    merged = {**json.loads((base / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    return out
