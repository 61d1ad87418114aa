"""Model shapes the GPU benchmarks time with dummy weights: configs laid over
a tiny checkpoint's (``decode_timing.shaped_model`` in benchmarks/). They
are the planner's named shapes (``vllm afd-plan --model qwen3-8b``), defined
once in vllm.afd.plan.shapes."""

from __future__ import annotations

from vllm.afd.plan.shapes import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS

__all__ = ["QWEN3_0_6B", "QWEN3_8B", "QWEN3_30B_A3B", "QWEN3_30B_A3B_LAYERS"]
