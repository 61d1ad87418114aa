# SPDX-License-Identifier: Apache-2.0
"""Fitting a GPU's effective rates (``rates.Rates``) to measured role
times: the roles of one 1A1F deployment on one GPU, each point a batch and
a context (``measure`` takes them; the GPU benchmarks' result files hold
the same). No GPU is needed here.

Each role's time is linear in the inverse rates (``cost.CostModel``):

* FFN, T tokens: ``L f_layer + W(T) / weight_bw + FLOPs(T) / flops``, W(T)
  the weights a pass reads (the experts its tokens touch). ``f_layer`` is
  fitted only where the points touch clearly different shares of the
  experts; otherwise it is indistinguishable from the weight read and stays
  at its default.
* Attention, b sequences of c tokens, with the weight read and GEMM FLOPs
  at the FFN's rates: ``L a_layer + b L a_seq + b (c kv + state) / kv_bw``.
* The exchange of roles that share a GPU: its mean per layer.
* The tail: the least of step - attention - FFN - exchange, less the LM head.

A coefficient that comes out non-positive (points that cannot tell it)
keeps its default, and the rest is fitted again."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
from vllm.afd.plan.cost import CostModel
from vllm.afd.plan.rates import Rates

TOUCHED_SPREAD = 0.2
"""Least spread of the touched expert share that tells ``ffn_layer_s`` apart."""


@dataclass(frozen=True)
class RoleSample:
    """One measured point of a 1A1F deployment on one GPU; times in seconds."""

    batch: int
    context: float
    """Mean context of the timed steps."""
    attention_s: float
    """The attention side's compute per step (``time_steps``)."""
    ffn_s: float
    """The FFN side's compute per step."""
    exchange_s: float
    """The attention side's exchange less the FFN's compute: the round trips."""
    step_s: float
    """The decode step."""

    @classmethod
    def from_benchmark(cls, results: dict, row: str = "AFD") -> list[RoleSample]:
        """The points of a GPU benchmark's results file with per-role times
        (benchmarks/afd_one_gpu_overlap.py). Each point is one generation
        whose timed windows follow the prompt, so the mean context is the
        prompt plus half of the decoded tokens."""
        decoded = results["decode_tokens"] * (1 + results["repeats"]) / 2
        roles = results["role_times_ms"][row]
        samples = []
        for p in results["points"]:
            t = roles[str(p["batch"])]
            steps = p["ms_per_step"][row]
            samples.append(
                cls(
                    p["batch"],
                    p["context"] + decoded,
                    t["attention"] / 1e3,
                    t["ffn"] / 1e3,
                    (t["attention_exchange"] - t["ffn"]) / 1e3,
                    sum(steps) / len(steps) / 1e3,
                )
            )
        return samples


@dataclass(frozen=True)
class FitRow:
    """A measured role time beside its fit."""

    batch: int
    context: float
    role: str
    measured_ms: float
    fitted_ms: float

    @property
    def error(self) -> float:
        return self.fitted_ms / self.measured_ms - 1


def _solve(
    columns: dict[str, np.ndarray], target: np.ndarray, defaults: dict[str, float]
) -> dict[str, float]:
    """Least squares over ``columns``; a non-positive coefficient takes its
    default (moved into the target) and the rest are solved again."""
    free = dict(columns)
    fixed: dict[str, float] = {}
    while free:
        rest = target - sum((columns[n] * v for n, v in fixed.items()), np.zeros_like(target))
        names = list(free)
        matrix = np.stack([free[n] for n in names], axis=1)
        scale = np.abs(matrix).max(axis=0)
        scale[scale == 0] = 1.0
        coef = np.linalg.lstsq(matrix / scale, rest, rcond=None)[0] / scale
        bad = [n for n, c in zip(names, coef, strict=True) if c <= 0]
        if not bad:
            return {**fixed, **dict(zip(names, coef.tolist(), strict=True))}
        for n in bad:
            fixed[n] = defaults[n]
            del free[n]
    return fixed


def fit_rates(
    cost: CostModel, samples: list[RoleSample], source: str
) -> tuple[Rates, list[FitRow]]:
    """The rates that ``samples``, measured on ``cost``'s shape, imply; the
    starting rates (``cost.rates``) are the defaults of what they cannot
    tell. Returns them with every measured time beside its fit."""
    m, start = cost.shape, cost.rates
    b = np.array([s.batch for s in samples], dtype=float)
    c = np.array([s.context for s in samples], dtype=float)
    layers = np.full_like(b, m.layers)

    touched = np.array([m.touched(t) for t in b])
    weights = (m.replicated_ffn_params + m.routed_params * touched) * m.weight_bytes
    flops = 2 * (m.replicated_ffn_params + m.top_k * m.expert_params * m.moe_layers) * b
    ffn_cols = {"ffn_layer_s": layers, "inv_weight_bw": weights, "inv_flops": flops}
    defaults = {
        "ffn_layer_s": start.ffn_layer_s,
        "inv_weight_bw": 1 / start.weight_bytes_per_s,
        "inv_flops": 1 / start.flops,
    }
    ffn_target = np.array([s.ffn_s for s in samples])
    if touched.max() - touched.min() < TOUCHED_SPREAD:
        ffn_target = ffn_target - layers * start.ffn_layer_s
        del ffn_cols["ffn_layer_s"]
    ffn = {**defaults, **_solve(ffn_cols, ffn_target, defaults)}
    rates = replace(
        start,
        ffn_layer_s=ffn["ffn_layer_s"],
        weight_bytes_per_s=1 / ffn["inv_weight_bw"],
        flops=1 / ffn["inv_flops"],
    )

    known = (
        m.attention_params * m.weight_bytes * ffn["inv_weight_bw"]
        + 2 * m.attention_params * b * ffn["inv_flops"]
    )
    att_cols = {
        "attention_layer_s": layers,
        "attention_seq_layer_s": b * layers,
        "inv_kv_bw": b * (c * m.kv_bytes_per_token + m.state_bytes_per_seq),
    }
    att_defaults = {
        "attention_layer_s": start.attention_layer_s,
        "attention_seq_layer_s": start.attention_seq_layer_s,
        "inv_kv_bw": 1 / start.kv_bytes_per_s,
    }
    att_target = np.array([s.attention_s for s in samples]) - known
    att = _solve(att_cols, att_target, att_defaults)
    rates = replace(
        rates,
        attention_layer_s=att["attention_layer_s"],
        attention_seq_layer_s=att["attention_seq_layer_s"],
        kv_bytes_per_s=1 / att["inv_kv_bw"],
        shared_gpu_exchange_layer_s=float(np.mean([s.exchange_s for s in samples])) / m.layers,
        source=source,
    )

    fitted = replace(cost, rates=replace(rates, tail_s=0.0))
    tail = min(
        s.step_s - s.attention_s - s.ffn_s - s.exchange_s - fitted.tail(s.batch) for s in samples
    )
    rates = replace(rates, tail_s=max(0.0, tail))
    fitted = replace(cost, rates=rates)
    rows = []
    for s in samples:
        predicted = {
            "attention": fitted.attention(s.batch, s.context),
            "ffn": fitted.ffn(s.batch, s.batch, 1),
            "step": fitted.shared_gpu_afd_step(s.batch, s.context),
        }
        measured = {"attention": s.attention_s, "ffn": s.ffn_s, "step": s.step_s}
        rows += [
            FitRow(s.batch, s.context, role, 1e3 * measured[role], 1e3 * v)
            for role, v in predicted.items()
        ]
    return rates, rows


def rows_as_dicts(rows: list[FitRow]) -> list[dict]:
    return [asdict(r) | {"error": r.error} for r in rows]
