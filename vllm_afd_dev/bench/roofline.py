"""The roofline of one GPU shared by AFD's two roles: each role's work per
decode step from the model's shape, and the bound on what overlapping them
can gain (benchmarks/afd_one_gpu_overlap.py, whose docstring derives it).

A role alone takes max(bytes / HBM bandwidth, FLOPs / peak). Colocated runs
the roles one after the other, so its ideal is the sum; overlapped roles on
one GPU share its bandwidth and SMs, so their ideal is max(total bytes /
bandwidth, total FLOPs / peak), with each stage reading the weights again.
"""

from __future__ import annotations

from dataclasses import dataclass

HBM_BYTES_PER_S = 4.8e12
"""H200 memory bandwidth, its specification."""
PEAK_FLOPS = 989e12
"""H200 dense bf16 tensor FLOP/s, its specification."""
BF16 = 2


@dataclass
class Work:
    """Bytes read and FLOPs of one role's part of a decode step."""

    bytes: float
    flops: float

    def ms(self) -> float:
        """Alone on the GPU: the slower of its bandwidth and its compute."""
        return 1e3 * max(self.bytes / HBM_BYTES_PER_S, self.flops / PEAK_FLOPS)

    def __add__(self, other: Work) -> Work:
        return Work(self.bytes + other.bytes, self.flops + other.flops)


def role_work(cfg: dict, batch: int, context: int, stages: int = 1) -> tuple[Work, Work]:
    """(attention, FFN) work of one decode step of ``batch`` sequences at
    ``context`` tokens, split into ``stages`` passes (each reads the weights)."""
    h, layers, hd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    attn_weights = layers * (h * q + 2 * h * kv + q * h) + cfg["vocab_size"] * h  # + lm head
    kv_bytes = BF16 * batch * context * layers * 2 * kv
    attention = Work(
        bytes=stages * BF16 * attn_weights + kv_bytes,
        flops=2 * attn_weights * batch + 4 * batch * context * layers * q,
    )
    if "num_local_experts" in cfg:
        experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
        expert = 3 * h * cfg["moe_intermediate_size"]
        per_stage = batch / stages
        touched = experts * (1 - (1 - top_k / experts) ** per_stage)
        ffn = Work(
            bytes=stages * BF16 * layers * (touched * expert + h * experts),
            flops=2 * layers * batch * (top_k * expert + h * experts),
        )
    else:
        mlp = layers * 3 * h * cfg["intermediate_size"]
        ffn = Work(bytes=stages * BF16 * mlp, flops=2 * mlp * batch)
    return attention, ffn


def bound(cfg: dict, batch: int, context: int, stages: int) -> float:
    """Colocated's ideal step over an AFD row's (module docstring); without
    stages the roles take turns, as colocated's do: 1."""
    if stages == 1:
        return 1.0
    serial = sum(w.ms() for w in role_work(cfg, batch, context))
    attention, ffn = role_work(cfg, batch, context, stages)
    return serial / (attention + ffn).ms()
