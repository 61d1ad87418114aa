# SPDX-License-Identifier: Apache-2.0
"""A plan as text for people and as JSON for tools."""

from __future__ import annotations

from vllm.afd.plan.cost import CostModel
from vllm.afd.plan.search import Option, Plan

TERMS = ("attention", "ffn", "all_to_all", "exchange", "tail", "dp_sync", "host")


def _gpu_ms_per_1k_tokens(option: Option) -> dict[str, float]:
    """Each term's GPU time per 1000 output tokens: what a term costs the
    deployment, comparable between AFD and colocated."""
    tokens = option.attention_gpus * option.batch
    return {t: 1e6 * v * option.gpus / tokens for t, v in option.step.terms.items()}


def as_dict(plan: Plan, cost: CostModel) -> dict:
    t = plan.target
    return {
        "model": cost.shape.name,
        "gpu": cost.gpu.name,
        "rates": cost.rates.source,
        "gpus": t.gpus,
        "tpot_ms": 1e3 * t.tpot_s,
        "context": t.context,
        "concurrency": t.concurrency,
        "afd": {str(s): o.as_dict() if o else None for s, o in plan.afd.items()},
        "colocated": plan.colocated.as_dict() if plan.colocated else None,
        "afd_over_colocated": plan.ratio,
        "closed_form_ratio": plan.closed_form_ratio,
    }


def _option_line(name: str, o: Option | None) -> str:
    if o is None:
        return f"  {name:22s} meets neither the TPOT nor the memory"
    split = f"{o.attention_gpus}A{o.ffn_gpus}F" if o.ffn_gpus else f"DP{o.attention_gpus}+EP"
    bound = f", bound by {o.step.bound_by}" if o.step.bound_by else ""
    return (
        f"  {name:22s} {split:8s} batch {o.batch:5d} per rank ({o.limit} limits it)  step "
        f"{1e3 * o.step.total:7.2f} ms{bound}  ->  {o.tok_s_per_gpu:8.0f} tok/s per GPU"
    )


def as_text(plan: Plan, cost: CostModel) -> str:
    t = plan.target
    lines = [
        f"{cost.shape.name} on {t.gpus} x {cost.gpu.name} ({cost.rates.source}), TPOT "
        f"{1e3 * t.tpot_s:g} ms, context {t.context:g}"
        + (f", {t.concurrency} sequences in flight" if t.concurrency else ""),
    ]
    for s, o in plan.afd.items():
        lines.append(_option_line(f"AFD, {s} stage{'s' if s > 1 else ''}", o))
    lines.append(
        _option_line(
            "colocated" + (", dual batch" if plan.colocated and plan.colocated.stages == 2 else ""),
            plan.colocated,
        )
    )
    best = plan.best_afd
    if plan.ratio is not None and best is not None:
        lines.append(
            f"  best AFD / colocated: {plan.ratio:.2f} "
            f"({best.attention_gpus}A{best.ffn_gpus}F, {best.stages} stage(s))"
        )
    if plan.closed_form_ratio is not None and plan.afd.get(1):
        serial = plan.afd[1]
        lines.append(
            f"  A:F closed form (rA-1F, serial, batch {serial.batch}): "
            f"{plan.closed_form_ratio:.1f}:1; search: "
            f"{serial.attention_gpus / serial.ffn_gpus:.1f}:1"
        )
    shown = [(n, o) for n, o in (("AFD", best), ("colocated", plan.colocated)) if o]
    if shown:
        lines.append("  terms, ms per step | GPU-ms per 1000 tokens:")
        lines.append("    " + " " * 11 + "".join(f"{n:>26s}" for n, _ in shown))
        costs = [_gpu_ms_per_1k_tokens(o) for _, o in shown]
        for term in TERMS:
            cells = "".join(
                f"{1e3 * o.step.terms[term]:12.2f} | {c[term]:11.2f}"
                for (_, o), c in zip(shown, costs, strict=True)
            )
            lines.append(f"    {term:11s}{cells}")
        if len(shown) == 2:
            gap = {term: costs[0][term] - costs[1][term] for term in TERMS}
            order = sorted(gap, key=lambda k: abs(gap[k]), reverse=True)[:3]
            lines.append(
                "  what decides it (AFD - colocated, GPU-ms per 1000 tokens): "
                + ", ".join(f"{k} {gap[k]:+.1f}" for k in order)
            )
    return "\n".join(lines)
