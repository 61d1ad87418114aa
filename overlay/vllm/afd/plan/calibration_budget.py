# SPDX-License-Identifier: Apache-2.0
"""How deep a calibration run may be, and the attention engine's memory
settings, on the one GPU that ``vllm afd-plan --calibrate`` shares between
an FFN rank and an attention engine.

The spawned FFN rank loads its weights before the attention engine starts,
so the engine's default ``gpu_memory_utilization`` (0.92 of the whole GPU)
cannot be free then, and vLLM refuses to start. Here the engine gets a KV
cache of what the calibration points need (``kv_cache_memory_bytes``) and a
``gpu_memory_utilization`` of its own share; the model is cut to the most
layers whose two processes fit in the GPU's free memory, less a margin (the
rates are per layer, so a cut model measures them as well). GPU-free: the
caller passes the GPU's free and total bytes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm.afd.plan.cost import BF16, GIB, RESERVED_GIB
from vllm.afd.plan.measure import LENGTH_SLACK
from vllm.afd.plan.shapes import ModelShape

MARGIN = 0.08
"""The share of the GPU left unplanned: what the estimates miss (as much as
vLLM's default ``gpu_memory_utilization`` leaves)."""
BLOCK_TOKENS = 16
"""vLLM's KV cache block: a sequence takes whole blocks."""
KV_SLACK = 1.1
"""The KV cache over what the points' sequences take: one more block each,
and room for vLLM's page rounding."""


@dataclass(frozen=True)
class CalibrationBudget:
    """The calibration run's depth and the attention engine's memory."""

    layers: int
    """Decoder layers the run keeps (the model's own, or fewer to fit)."""
    model_layers: int
    """The model's decoder layers."""
    ffn_bytes: int
    """The FFN rank's need: its weights and ``RESERVED_GIB``."""
    attention_bytes: int
    """The attention engine's need: weights, embedding and LM head, KV
    cache and ``RESERVED_GIB``."""
    kv_cache_memory_bytes: int
    """The attention engine's KV cache (and recurrent state)."""
    gpu_memory_utilization: float
    """The attention engine's share of the whole GPU (vLLM checks at start
    that this much is free, after the FFN rank has loaded)."""

    def engine_args(self) -> dict:
        return {
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }

    def describe(self) -> str:
        depth = (
            f"all {self.layers} layers"
            if self.layers == self.model_layers
            else f"{self.layers} of {self.model_layers} layers (the rates are per layer)"
        )
        return (
            f"calibrating on {depth}: FFN rank {self.ffn_bytes / GIB:.1f} GiB, attention "
            f"engine {self.attention_bytes / GIB:.1f} GiB (KV cache "
            f"{self.kv_cache_memory_bytes / GIB:.1f} GiB, gpu_memory_utilization "
            f"{self.gpu_memory_utilization:.2f})"
        )


def _kv_bytes(shape: ModelShape, points: Sequence[tuple[int, int]], decode_tokens: int) -> int:
    """The largest point's KV cache and recurrent state, in whole blocks."""
    need = 0.0
    for batch, context in points:
        blocks = math.ceil((context + decode_tokens + LENGTH_SLACK) / BLOCK_TOKENS) + 1
        per_seq = blocks * BLOCK_TOKENS * shape.kv_bytes_per_token + shape.state_bytes_per_seq
        need = max(need, batch * per_seq)
    return int(need * KV_SLACK)


def _needs(shape: ModelShape, kv: int) -> tuple[int, int]:
    """(FFN rank, attention engine) bytes of ``shape`` with a KV cache of ``kv``."""
    reserved = RESERVED_GIB * GIB
    ffn = (shape.replicated_ffn_params + shape.routed_params) * shape.weight_bytes
    attention = shape.attention_params * shape.weight_bytes + 2 * shape.embedding_params * BF16
    return int(ffn + reserved), int(attention + kv + reserved)


def calibration_budget(
    shape_at: Callable[[int | None], ModelShape],
    points: Sequence[tuple[int, int]],
    decode_tokens: int,
    free_bytes: int,
    total_bytes: int,
    layers: int | None = None,
) -> CalibrationBudget:
    """The budget of a calibration run at ``points``: ``layers`` deep if
    given (refused with the numbers if it cannot fit), else the most layers
    that fit. ``shape_at(n)`` is the model cut to ``n`` layers (``None``:
    whole)."""
    model_layers = shape_at(None).layers
    available = free_bytes - MARGIN * total_bytes

    def budget(n: int) -> CalibrationBudget:
        shape = shape_at(n)
        kv = _kv_bytes(shape, points, decode_tokens)
        ffn, attention = _needs(shape, kv)
        return CalibrationBudget(
            n, model_layers, ffn, attention, kv, math.ceil(100 * attention / total_bytes) / 100
        )

    def fits(b: CalibrationBudget) -> bool:
        return b.ffn_bytes + b.attention_bytes <= available

    if layers is not None:
        if not 1 <= layers <= model_layers:
            raise ValueError(
                f"--calibrate-layers {layers}: the model has {model_layers} decoder layers"
            )
        chosen = budget(layers)
        if not fits(chosen):
            raise ValueError(
                f"--calibrate-layers {layers} does not fit this GPU: FFN rank "
                f"{chosen.ffn_bytes / GIB:.1f} GiB + attention engine "
                f"{chosen.attention_bytes / GIB:.1f} GiB > {available / GIB:.1f} GiB free "
                f"(of {total_bytes / GIB:.1f} GiB, less {MARGIN:.0%}); give fewer layers, "
                "or leave --calibrate-layers out to take the most that fit"
            )
        return chosen
    deepest = next((b for n in range(model_layers, 0, -1) if fits(b := budget(n))), None)
    if deepest is None:
        one = budget(1)
        raise ValueError(
            f"not even one layer of the model fits this GPU beside the points' KV cache: "
            f"FFN rank {one.ffn_bytes / GIB:.1f} GiB + attention engine "
            f"{one.attention_bytes / GIB:.1f} GiB > {available / GIB:.1f} GiB free; free the "
            "GPU, or give smaller --calibrate-points"
        )
    return deepest
