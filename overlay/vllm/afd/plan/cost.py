# SPDX-License-Identifier: Apache-2.0
"""Each role's time per decode step, from a model's shape, a GPU's fabric
and its effective rates, for AFD (A attention GPUs, F FFN GPUs that form one
expert-parallel group) and for colocated data-parallel + expert-parallel
serving (every GPU runs attention and its share of the experts).

A pass of a role reads its weights once (a MoE pass reads the experts its
tokens touch), so s micro-batch stages read them s times; tokens add FLOPs
and, for attention, their KV reads. Expert parallelism over G GPUs adds an
all-to-all per MoE layer (dispatch and combine) and spreads the routed
experts, whose busiest GPU sets the pace. Data-parallel ranks, AFD's
attention ranks included, synchronise once per step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm.afd.plan.hardware import GPUSpec
from vllm.afd.plan.rates import Rates
from vllm.afd.plan.shapes import ModelShape

GIB = 2**30
BF16 = 2
MEMORY_UTILIZATION = 0.9
"""vLLM's default ``gpu_memory_utilization``."""
RESERVED_GIB = 2.0
"""Activations, CUDA graphs and the allocator's slack per GPU."""


@dataclass
class Step:
    """One decode step's terms (seconds) and how they combine."""

    terms: dict[str, float]
    """attention, ffn, all_to_all, exchange, tail, dp_sync, host."""
    total: float
    """The step: terms combined as the schedule runs them."""
    bound_by: str = ""
    """The term that sets a pipelined step (empty for a serial one)."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CostModel:
    shape: ModelShape
    gpu: GPUSpec
    rates: Rates

    # -- the roles ----------------------------------------------------------
    def attention(self, b: float, context: float, stages: int = 1) -> float:
        """b sequences of ``context`` tokens: the weights per pass, then per
        sequence its GEMM FLOPs and the slower of its KV read and its
        attention FLOPs (bf16)."""
        m, r = self.shape, self.rates
        fixed = (
            m.layers * r.attention_layer_s
            + m.attention_params * m.weight_bytes / r.weight_bytes_per_s
        )
        context_flops = r.flops * self.gpu.flops_for("bf16") / self.gpu.flops_for(self.dtype)
        per_seq = (
            m.layers * r.attention_seq_layer_s
            + 2 * m.attention_params / r.flops
            + max(
                (context * m.kv_bytes_per_token + m.state_bytes_per_seq) / r.kv_bytes_per_s,
                context * m.attention_flops_per_context_token / context_flops,
            )
        )
        return stages * fixed + b * per_seq

    def ffn(self, tokens: float, home: float, ep: int, stages: int = 1) -> float:
        """One GPU of an expert-parallel group of ``ep``: ``tokens`` tokens in
        the whole group, ``home`` of them this GPU's own (replicated weights:
        dense MLPs, shared experts, routers run on them)."""
        m, r = self.shape, self.rates
        routed_bytes = m.routed_params * m.touched(tokens / stages) / ep
        per_pass = (
            m.layers * r.ffn_layer_s
            + (m.replicated_ffn_params + routed_bytes) * m.weight_bytes / r.weight_bytes_per_s
        )
        routed_flops = 2 * m.top_k * m.expert_params * m.moe_layers * tokens / ep
        flops = 2 * m.replicated_ffn_params * home + routed_flops * self.imbalance(tokens, ep)
        return stages * per_pass + flops / r.flops

    def imbalance(self, tokens: float, ep: int) -> float:
        """The busiest GPU's routed load over the mean, routing uniform:
        about mean + sqrt(2 ln G) standard deviations of a Poisson count."""
        mean = tokens * self.shape.top_k / ep
        if ep == 1 or mean <= 0:
            return 1.0
        return 1 + math.sqrt(2 * math.log(ep) / mean)

    def all_to_all(self, home: float, ep: int, stages: int = 1) -> float:
        """Dispatch and combine of every MoE layer for ``home`` tokens per GPU
        of a group of ``ep``: each token goes to the distinct remote GPUs of
        its experts (FP8 out for an FP8 model, bf16 back)."""
        m, g = self.shape, self.gpu
        if ep == 1 or not m.experts:
            return 0.0
        remote = (ep - 1) * (1 - (1 - 1 / ep) ** m.top_k)
        bytes_out = home * remote * m.hidden * (m.weight_bytes + BF16)
        if ep <= g.domain_gpus:
            latency, seconds = g.link_latency_s, bytes_out / g.link_bytes_per_s
        else:
            off = (ep - g.domain_gpus) / (ep - 1)
            latency = g.scaleout_latency_s
            seconds = max(
                (1 - off) * bytes_out / g.link_bytes_per_s, off * bytes_out / g.scaleout_bytes_per_s
            )
        return m.moe_layers * (stages * 2 * latency + seconds)

    def exchange(self, home: float, gpus: int, stages: int = 1) -> float:
        """AFD's round trips of every layer: ``home`` rows into the busiest
        FFN GPU and back (bf16)."""
        m, g = self.shape, self.gpu
        inside = gpus <= g.domain_gpus
        latency = g.link_latency_s if inside else g.scaleout_latency_s
        bandwidth = g.link_bytes_per_s if inside else g.scaleout_bytes_per_s
        per_layer = stages * (2 * latency + self.rates.exchange_layer_s)
        return m.layers * (per_layer + 2 * home * m.hidden * BF16 / bandwidth)

    def tail(self, b: float) -> float:
        """Final norm, LM head (bf16) and sampler."""
        head = self.shape.embedding_params
        return (
            self.rates.tail_s
            + head * BF16 / self.rates.weight_bytes_per_s
            + 2 * head * b / self.rates.flops
        )

    def dp_sync(self, ranks: int) -> float:
        """vLLM's per-step agreement of data-parallel ranks: a small
        all-reduce over their hosts."""
        return 0.0 if ranks == 1 else 2 * math.ceil(math.log2(ranks)) * self.gpu.host_sync_s

    @property
    def dtype(self) -> str:
        return "fp8" if self.shape.weight_bytes == 1 else "bf16"

    # -- memory -------------------------------------------------------------
    def _usable(self) -> float:
        return (self.gpu.memory_gib * MEMORY_UTILIZATION - RESERVED_GIB) * GIB

    def _attention_weights(self) -> float:
        m = self.shape
        return m.attention_params * m.weight_bytes + 2 * m.embedding_params * BF16

    def _ffn_weights(self, ep: int) -> float:
        m = self.shape
        return (m.replicated_ffn_params + m.routed_params / ep) * m.weight_bytes

    def _per_seq(self, context: float) -> float:
        return context * self.shape.kv_bytes_per_token + self.shape.state_bytes_per_seq

    def afd_capacity(self, context: float, ffn_gpus: int) -> int:
        """Sequences an attention GPU holds; 0 if the FFN GPUs cannot hold the experts."""
        if self._ffn_weights(ffn_gpus) > self._usable():
            return 0
        return max(0, int((self._usable() - self._attention_weights()) / self._per_seq(context)))

    def colocated_capacity(self, context: float, gpus: int) -> int:
        free = self._usable() - self._attention_weights() - self._ffn_weights(gpus)
        return max(0, int(free / self._per_seq(context)))

    # -- whole steps --------------------------------------------------------
    def afd_step(
        self, attention_gpus: int, ffn_gpus: int, b: float, context: float, stages: int = 1
    ) -> Step:
        """b sequences on each of ``attention_gpus``; the FFN GPUs form one
        expert-parallel group, each the home of ceil(A/F) attention ranks.
        Serial: the roles take turns. Two stages hide one role's compute
        behind the other's, not the exchange (as measured on this project's
        pipeline, docs/performance.md); three hide the exchange too, leaving
        one stage's pass through one layer to fill the pipeline."""
        a, f, s = attention_gpus, ffn_gpus, stages
        home = math.ceil(a / f) * b
        terms = {
            "attention": self.attention(b, context, s),
            "ffn": self.ffn(a * b, home, f, s),
            "all_to_all": self.all_to_all(home, f, s),
            "exchange": self.exchange(home, a + f, s),
            "tail": self.tail(b),
            "dp_sync": self.dp_sync(a),
            "host": self.rates.host_seq_s * b,
        }
        ffn_side = terms["ffn"] + terms["all_to_all"]
        rest = terms["tail"] + terms["dp_sync"]
        if s == 1:
            gpu, bound_by = terms["attention"] + ffn_side + terms["exchange"] + rest, ""
        elif s == 2:
            core = {"attention": terms["attention"], "ffn": ffn_side}
            bound_by = max(core, key=core.get)
            gpu = core[bound_by] + terms["exchange"] + rest
        else:
            core = {"attention": terms["attention"], "ffn": ffn_side, "exchange": terms["exchange"]}
            bound_by = max(core, key=core.get)
            fill = sum(core.values()) / (s * self.shape.layers)
            gpu = core[bound_by] + fill + rest
        return self._with_host(terms, gpu, bound_by)

    def colocated_step(self, gpus: int, b: float, context: float, stages: int = 1) -> Step:
        """b sequences on each of ``gpus`` DP ranks, the experts spread over
        them by expert parallelism. Two stages (vLLM's dual-batch overlap)
        hide the all-to-all behind the other micro-batch's compute."""
        terms = {
            "attention": self.attention(b, context, stages),
            "ffn": self.ffn(gpus * b, b, gpus, stages),
            "all_to_all": self.all_to_all(b, gpus, stages),
            "exchange": 0.0,
            "tail": self.tail(b),
            "dp_sync": self.dp_sync(gpus),
            "host": self.rates.host_seq_s * b,
        }
        compute = terms["attention"] + terms["ffn"]
        rest = terms["tail"] + terms["dp_sync"]
        if stages == 1:
            gpu, bound_by = compute + terms["all_to_all"] + rest, ""
        else:
            core = {"compute": compute, "all_to_all": terms["all_to_all"]}
            bound_by = max(core, key=core.get)
            gpu = core[bound_by] + rest
        return self._with_host(terms, gpu, bound_by)

    def shared_gpu_afd_step(self, b: float, context: float) -> float:
        """1A1F with both roles on one GPU under MPS: the roles take turns,
        and the exchange is the shared GPU's round trip (a calibration run)."""
        exchange = self.shape.layers * self.rates.shared_gpu_exchange_layer_s
        return self.attention(b, context) + self.ffn(b, b, 1) + exchange + self.tail(b)

    @staticmethod
    def _with_host(terms: dict[str, float], gpu: float, bound_by: str) -> Step:
        if terms["host"] > gpu:
            return Step(terms, terms["host"], "host")
        return Step(terms, gpu, bound_by)
