# SPDX-License-Identifier: Apache-2.0
"""The plan: for N GPUs, a TPOT target and a context length, the A:F split,
batch per rank and stages that give AFD the most tokens/s per GPU, the same
for colocated DP+EP, and the A:F ratio's closed form as a cross-check.

Within one layout a step grows with the batch and tokens/s per GPU grows
with it too (a step's fixed part is shared by more sequences), so the best
batch is the largest that meets the TPOT and fits the memory: a bisection."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from vllm.afd.plan.cost import CostModel, Step


@dataclass(frozen=True)
class Target:
    """What the user asks for."""

    gpus: int
    """GPUs of the deployment, both roles together."""
    tpot_s: float
    """Time per output token that every step must meet."""
    context: float
    """Mean context length (KV tokens) of a decoding sequence."""
    concurrency: int | None = None
    """Sequences in flight in the whole deployment, if the load caps them."""
    stages: tuple[int, ...] = (1, 2, 3)
    """AFD's micro-batch stages to consider."""


@dataclass
class Option:
    """One deployment at its best batch."""

    attention_gpus: int
    """AFD: attention GPUs; colocated: every GPU."""
    ffn_gpus: int
    """AFD: FFN GPUs; colocated: 0."""
    stages: int
    batch: int
    """Sequences per attention (DP) rank."""
    step: Step
    tok_s_per_gpu: float
    limit: str = "tpot"
    """What stops a larger batch: "tpot", or "memory" / "concurrency" at the cap."""

    @property
    def gpus(self) -> int:
        return self.attention_gpus + self.ffn_gpus

    def as_dict(self) -> dict:
        return {
            "attention_gpus": self.attention_gpus,
            "ffn_gpus": self.ffn_gpus,
            "stages": self.stages,
            "batch_per_rank": self.batch,
            "step_ms": 1e3 * self.step.total,
            "bound_by": self.step.bound_by,
            "terms_ms": {k: 1e3 * v for k, v in self.step.terms.items()},
            "tok_s_per_gpu": self.tok_s_per_gpu,
            "limit": self.limit,
        }


@dataclass
class Plan:
    target: Target
    afd: dict[int, Option | None]
    """Best AFD option by stages (None: no split meets the target)."""
    colocated: Option | None
    closed_form_ratio: float | None
    """A:F from the closed form at the best serial AFD option's batch."""
    notes: list[str] = field(default_factory=list)

    @property
    def best_afd(self) -> Option | None:
        found = [o for o in self.afd.values() if o is not None]
        return max(found, key=lambda o: o.tok_s_per_gpu, default=None)

    @property
    def ratio(self) -> float | None:
        """Best AFD over colocated, tokens/s per GPU."""
        best = self.best_afd
        if best is None or self.colocated is None:
            return None
        return best.tok_s_per_gpu / self.colocated.tok_s_per_gpu


def largest_batch(step: Callable[[int], Step], cap: int, tpot_s: float) -> tuple[int, Step] | None:
    """The largest b <= cap whose step meets ``tpot_s``, with that step."""
    if cap < 1 or step(1).total > tpot_s:
        return None
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step(mid).total <= tpot_s else (lo, mid - 1)
    return lo, step(lo)


def _cap(capacity: int, concurrency: int | None, ranks: int) -> tuple[int, str]:
    """The largest batch per rank and what sets it."""
    if concurrency is not None and math.ceil(concurrency / ranks) < capacity:
        return math.ceil(concurrency / ranks), "concurrency"
    return capacity, "memory"


def best_afd(cost: CostModel, target: Target, stages: int) -> Option | None:
    best = None
    for a in range(1, target.gpus):
        f = target.gpus - a
        cap, limit = _cap(cost.afd_capacity(target.context, f), target.concurrency, a)
        step_of = partial(cost.afd_step, a, f, context=target.context, stages=stages)
        found = largest_batch(step_of, cap, target.tpot_s)
        if found is None:
            continue
        b, step = found
        option = Option(
            a, f, stages, b, step, a * b / step.total / target.gpus, limit if b == cap else "tpot"
        )
        if best is None or option.tok_s_per_gpu > best.tok_s_per_gpu:
            best = option
    return best


def best_colocated(cost: CostModel, target: Target) -> Option | None:
    n = target.gpus
    cap, limit = _cap(cost.colocated_capacity(target.context, n), target.concurrency, n)
    options = []
    for stages in (1, 2):  # serial, or dual-batch overlap
        step_of = partial(cost.colocated_step, n, context=target.context, stages=stages)
        found = largest_batch(step_of, cap, target.tpot_s)
        if found is not None:
            b, step = found
            options.append(
                Option(n, 0, stages, b, step, b / step.total, limit if b == cap else "tpot")
            )
    return max(options, key=lambda o: o.tok_s_per_gpu, default=None)


def closed_form_ratio(cost: CostModel, b: int, context: float) -> float:
    """r* of an rA-1F bundle without stages: the step is C + k r (r
    attention ranks of b sequences feed one FFN GPU), tokens/s per GPU is
    r b / ((r + 1)(C + k r)), whose maximum is at r = sqrt(C / k)."""
    one, two = (cost.afd_step(r, 1, b, context).total for r in (1, 2))
    k = two - one
    return math.sqrt((one - k) / k) if k > 0 else math.inf


def plan(cost: CostModel, target: Target) -> Plan:
    if target.gpus < 2:
        raise ValueError("AFD needs at least 2 GPUs (one per role)")
    afd = {s: best_afd(cost, target, s) for s in target.stages}
    serial = afd.get(1)
    ratio = closed_form_ratio(cost, serial.batch, target.context) if serial else None
    return Plan(target, afd, best_colocated(cost, target), ratio)
