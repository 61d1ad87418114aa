"""A performance model of AFD decode: each role's compute measured at the
model's full depth on one GPU, the exchange between the roles measured on two
GPUs. It checks itself against every measured decode step, then predicts
tokens per second per GPU of nA:mF deployments against colocated data
parallelism at a TPOT target.

The command, with the results files it reads, is
benchmarks/afd_perf_model.py.

Components, ms per decode step (the layer loop's terms scale with depth):

* ``A(b, c) = a0 + a1 b + a_kv b c``: attention for b sequences of c context
  tokens (kernels, per-sequence work, the KV read); three terms solved from
  the three points, so exact there; s stages cost ``s a0 + (a1 + a_kv c) b``
  (each stage launches every kernel again).
* ``F(T) = f_w u(T) + f1 T``: one FFN pass over T tokens, where
  ``u(T) = 1 - (1 - k/E)^T`` is the share of the E experts that T tokens
  touch, each routed to k of them uniformly: the weight read grows with it
  and saturates (98% at 64 tokens for 128 experts, top-8); least squares.
* ``x(b) = x0 + x1 b``: the exchange per step, the attention side's exchange
  less the FFN's compute in the AFD row (the roles run in series there).
* ``tail``: final norm, logits and sampler, outside the layer loop: the least
  ``other`` (step less the attention side's layer loop) of the AFD row.
* ``H(b) = h1 b``: the host's time per step for b sequences in one engine,
  which async scheduling hides until it is the longer; from the two-GPU
  points whose ``other`` exceeds three tails.
* ``c_dp(b) = c0 + c1 b``: colocated DP's dispatch, combine and per-step
  coordination: colocated DP2's step less its modelled GPU work, solved at
  two batches (``--calibrate-batches``) and checked at the others. Measured
  at 8 layers only. c0 grows with depth (the latency of each layer's
  collectives); c1 is taken both ways in the predictions: grown with depth
  too, and as measured, once per step (DP's coordination and host work:
  grown, it would be 1.6 us per sequence per layer, about 30 times an nccl
  round trip of a token's hidden state, afd_nccl_roundtrip.json).

AFD with n attention ranks, m FFN ranks, b sequences per attention rank and
s stages: each FFN rank runs T = n b / m tokens per step with every expert
(``ffn_ep``: n b tokens with 1/m of the experts, as one FFN rank group with
``ffn_enable_expert_parallel``); step = max(GPU, H(b)), GPU = A + F + x +
tail in series, or max(attention over s stages, FFN over s passes) + x +
tail pipelined. On one GPU the same, with that GPU's exchange and tail.
Colocated DP over N GPUs shards the experts (vLLM's DP for MoE), one engine
per rank: A(b) + F(N b) / N + c_dp(b) + tail (no c_dp on one GPU). KV
capacity bounds b (``--context``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

GiB = 2**30
BF16 = 2
SHORT_PROMPT = 16
"""Prompt tokens of benchmarks/decode_timing.py's runs that give no contexts."""
ONE_GPU_ROWS = {"AFD": "AFD graphs, MPS on", "colocated": "colocated graphs, MPS on"}
"""Model row -> row of the one-GPU steps file."""
LAYER_LOOP_TERMS = ("a0", "a1", "a_kv", "f_w", "f1", "x0", "x1", "c0")
TOPOLOGIES = [(1, 1, False), (3, 1, False), (6, 2, False), (6, 2, True), (28, 4, False),
              (28, 4, True)]  # fmt: skip
"""(attention ranks, FFN ranks, FFN expert parallel) of the predictions."""


def least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """The coefficients c minimizing sum((row . c - value)^2): normal
    equations on columns scaled to 1 (their magnitudes differ by 10^6),
    solved by elimination; exact where there are as many rows as terms."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    x = [[r[j] / scale[j] for j in range(n)] for r in rows]
    system = [
        [sum(r[i] * r[j] for r in x) for j in range(n)]
        + [sum(r[i] * v for r, v in zip(x, values, strict=True))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(system[i][col]))
        system[col], system[pivot] = system[pivot], system[col]
        for i in range(n):
            if i != col:
                factor = system[i][col] / system[col][col]
                system[i] = [a - factor * b for a, b in zip(system[i], system[col], strict=True)]
    return [system[j][n] / system[j][j] / scale[j] for j in range(n)]


def touched(tokens: float, experts: int, top_k: int) -> float:
    """Share of ``experts`` touched by ``tokens`` tokens routed to ``top_k``
    each, uniformly."""
    return 1 - (1 - top_k / experts) ** tokens


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass
class Point:
    """One measured point of the role-time file: ``batch`` sequences at a
    mean ``context`` over the timed steps."""

    batch: int
    context: float
    roles: dict[str, float]
    """The AFD row's per-role times (ms per step)."""
    steps: dict[str, float]
    """ms per step by row, mean of the timings."""


def role_time_points(results: dict) -> list[Point]:
    # Each point is one generation: its windows decode after the prompt, so
    # the context grows by half of them on average.
    decoded = results["decode_tokens"] * (1 + results["repeats"]) / 2
    roles = results["role_times_ms"]["AFD"]
    return [
        Point(p["batch"], p["context"] + decoded, roles[str(p["batch"])],
              {row: mean(ms) for row, ms in p["ms_per_step"].items()})
        for p in results["points"]
    ]  # fmt: skip


def short_context(results: dict) -> float:
    """Mean context of a run with short prompts: each timed generation
    decodes ``decode_tokens`` after the prompt."""
    return SHORT_PROMPT + results["decode_tokens"] / 2


def fit_attention(points: list[Point]) -> tuple[float, float, float]:
    """(a0, a1, a_kv) of ``A(b, c) = a0 + a1 b + a_kv b c``."""
    a0, a1, a_kv = least_squares([[1.0, p.batch, p.batch * p.context] for p in points],
                                 [p.roles["attention"] for p in points])  # fmt: skip
    return a0, a1, a_kv


def kv_read_bandwidth(a_kv: float, cfg: dict) -> float:
    """Bytes/s of KV cache read that ``a_kv`` (ms per context token per
    sequence, all layers) implies."""
    kv_bytes = BF16 * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * cfg["num_hidden_layers"]
    return kv_bytes / (a_kv / 1000)


@dataclass
class Model:
    layers: int
    """The depth that the layer loop's terms are given for."""
    experts: int
    top_k: int
    a0: float
    a1: float
    a_kv: float
    f_w: float
    f1: float
    x0: float
    x1: float
    tail: float
    h1: float
    c0: float = 0.0
    c1: float = 0.0
    dp_c1_per_layer: bool = True
    """Whether c_dp's per-sequence term grows with depth (work in every
    layer) or not (per-step coordination and host work)."""

    def scaled(self, layers: int) -> Model:
        k = layers / self.layers
        terms = LAYER_LOOP_TERMS + (("c1",) if self.dp_c1_per_layer else ())
        return replace(self, layers=layers, **{t: getattr(self, t) * k for t in terms})

    def attention(self, b: float, stages: int = 1, context: float = 0) -> float:
        return stages * self.a0 + (self.a1 + self.a_kv * context) * b

    def ffn(self, tokens: float, stages: int = 1, share: float = 1.0) -> float:
        """``stages`` passes over ``tokens`` in all, with ``share`` of the
        experts: each pass reads the experts that its tokens touch."""
        per_pass = touched(tokens / stages, self.experts, self.top_k)
        return share * (stages * self.f_w * per_pass + self.f1 * tokens)

    def exchange(self, b: float) -> float:
        return self.x0 + self.x1 * b

    def afd_step(self, n: int, m: int, b: float, stages: int = 1, ffn_ep: bool = False,
                 context: float = 0) -> float:  # fmt: skip
        tokens = n * b / m if not ffn_ep else n * b
        share = 1 / m if ffn_ep else 1.0
        att = self.attention(b, stages, context)
        ffn = self.ffn(tokens, stages, share)
        core = att + ffn if stages == 1 else max(att, ffn)
        return max(core + self.exchange(b) + self.tail, self.h1 * b)

    def colocated_gpu(self, gpus: int, b: float, context: float = 0) -> float:
        """A colocated rank's GPU work per step, b sequences per rank."""
        dp = self.c0 + self.c1 * b if gpus > 1 else 0.0
        return self.attention(b, 1, context) + self.ffn(gpus * b, 1, 1 / gpus) + dp + self.tail

    def colocated_step(self, gpus: int, b: float, context: float = 0) -> float:
        return max(self.colocated_gpu(gpus, b, context), self.h1 * b)


def fit(role_times: dict, two_gpu: dict, calibrate: list[int]) -> tuple[Model, Model]:
    """(GPUs of their own, one GPU shared under MPS), both at the role-time
    file's depth; they differ in the exchange and the tail."""
    cfg = role_times["model"]
    experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    layers = cfg["num_hidden_layers"]
    points = role_time_points(role_times)
    a0, a1, a_kv = fit_attention(points)
    f_w, f1 = least_squares([[touched(p.batch, experts, top_k), p.batch] for p in points],
                            [p.roles["ffn"] for p in points])  # fmt: skip
    shared_x0, shared_x1 = least_squares(
        [[1.0, p.batch] for p in points],
        [p.roles["attention_exchange"] - p.roles["ffn"] for p in points],
    )
    shared_tail = min(p.roles["other"] for p in points)

    depth = two_gpu["model"]["num_hidden_layers"]
    roles = {int(b): t for b, t in two_gpu["role_times_ms"]["AFD"].items()}
    steps = two_gpu["ms_per_step"]
    x0, x1 = least_squares(
        [[1.0, b] for b in roles], [t["attention_exchange"] - t["ffn"] for t in roles.values()]
    )
    tail = min(t["other"] for t in roles.values())
    h1 = max((steps["AFD"][str(b)] / b for b, t in roles.items() if t["other"] > 3 * tail),
             default=0.0)  # fmt: skip
    full = Model(layers, experts, top_k, a0, a1, a_kv, f_w, f1, 0.0, 0.0, tail, h1)
    shallow = replace(full.scaled(depth), x0=x0, x1=x1)
    context = short_context(two_gpu)
    c0, c1 = least_squares(
        [[1.0, b // 2] for b in calibrate],
        [steps["colocated DP2"][str(b)] - shallow.colocated_gpu(2, b // 2, context)
         for b in calibrate],
    )  # fmt: skip
    model = replace(shallow, c0=c0, c1=c1).scaled(layers)
    return model, replace(model, x0=shared_x0, x1=shared_x1, tail=shared_tail)


@dataclass
class CheckRow:
    source: str
    row: str
    batch: int
    context: int
    predicted: float
    measured: float
    fitted: bool
    """Whether the point took part in the fit of this row's terms (in sample)."""

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def check(model: Model, one_gpu: Model, role_times: dict, two_gpu: dict, one_gpu_steps: dict,
          calibrate: list[int]) -> list[CheckRow]:  # fmt: skip
    """Every measured point against the model. In sample: the per-role times
    and the AFD steps of the role-time file, the two-GPU AFD row (its exchange,
    tail and host time); the rest is predicted."""
    rows = []
    source = f"one GPU, {one_gpu.layers}-layer roles"
    for p in role_time_points(role_times):
        b, c = p.batch, p.context
        predicted = {
            "attention": (one_gpu.attention(b, context=c), p.roles["attention"], True),
            "FFN": (one_gpu.ffn(b), p.roles["ffn"], True),
            "AFD": (one_gpu.afd_step(1, 1, b, context=c), p.steps["AFD"], True),
            "colocated": (one_gpu.colocated_step(1, b, c), p.steps["colocated"], False),
        }
        rows += [CheckRow(source, row, b, round(c), *v) for row, v in predicted.items()]

    depth = one_gpu_steps["model"]["num_hidden_layers"]
    shared = one_gpu.scaled(depth)
    c = short_context(one_gpu_steps)
    measured = one_gpu_steps["ms_per_output_token"]
    for b in sorted(int(k) for k in measured[ONE_GPU_ROWS["AFD"]]):
        predicted = {"AFD": shared.afd_step(1, 1, b, context=c),
                     "colocated": shared.colocated_step(1, b, c)}  # fmt: skip
        rows += [CheckRow("one GPU, steps", row, b, round(c), p,
                          mean(measured[ONE_GPU_ROWS[row]][str(b)]), False)
                 for row, p in predicted.items()]  # fmt: skip

    shallow = model.scaled(two_gpu["model"]["num_hidden_layers"])
    source = f"two GPUs, {shallow.layers} layers"
    c = short_context(two_gpu)
    roles, steps = two_gpu["role_times_ms"]["AFD"], two_gpu["ms_per_step"]
    stages = two_gpu["stages"]
    for b in sorted(int(k) for k in steps["AFD"]):
        predicted = {
            "attention": (shallow.attention(b, context=c), roles[str(b)]["attention"], False),
            "FFN": (shallow.ffn(b), roles[str(b)]["ffn"], False),
            "AFD": (shallow.afd_step(1, 1, b, context=c), steps["AFD"][str(b)], True),
            "AFD overlap": (shallow.afd_step(1, 1, b, stages, context=c),
                            steps["AFD overlap"][str(b)], False),
        }  # fmt: skip
        if b not in calibrate:  # c_dp was solved there
            predicted["colocated DP2"] = (shallow.colocated_step(2, b // 2, c),
                                          steps["colocated DP2"][str(b)], False)  # fmt: skip
        rows += [CheckRow(source, row, b, round(c), *v) for row, v in predicted.items()]
    return rows


def best_throughput(
    step: Callable[[int], float], tpot_ms: float, max_b: int, ranks: int, gpus: int
) -> tuple[float, int, float]:
    """(tokens/s per GPU, b, step) at the largest b per rank whose step meets
    ``tpot_ms``; (0, 0, 0) if none does."""
    best = (0.0, 0, 0.0)
    for b in range(1, max_b + 1):
        t = step(b)
        if t <= tpot_ms:
            best = max(best, (1000 * ranks * b / t / gpus, b, t))
    return best


def predict(model: Model, c1_per_step: Model, cfg: dict, contexts: list[int],
            tpots: list[float], gpu_gib: float) -> list[dict]:  # fmt: skip
    """Tokens/s per GPU of AFD and colocated DP on every topology, at the
    best batch per rank that meets each TPOT and fits the KV cache; colocated
    with c_dp's c1 grown by depth (``model``) and once per step (``c1_per_step``)."""
    kv_bytes = BF16 * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * model.layers
    expert_gib = BF16 * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * model.experts
    expert_gib *= model.layers / GiB
    # Attention weights and embeddings.
    other_gib = BF16 * 4 * cfg["hidden_size"] * 4096 * model.layers / GiB + 1.2
    colocated_models = {"c1_per_layer": model, "c1_per_step": c1_per_step}
    predictions = []
    for context in contexts:
        kv_per_seq_gib = kv_bytes * max(context, 64) / GiB
        for tpot in tpots:
            for n, m, ep in TOPOLOGIES:
                gpus = n + m
                if (expert_gib / m if ep else expert_gib) > gpu_gib:
                    continue
                att_b = int((gpu_gib - other_gib) / kv_per_seq_gib)
                col_b = int((gpu_gib - other_gib - expert_gib / gpus) / kv_per_seq_gib)
                col = {
                    name: best_throughput(partial(cm.colocated_step, gpus, context=context),
                                          tpot, min(col_b, 1024), gpus, gpus)
                    for name, cm in colocated_models.items()
                }  # fmt: skip
                afd = {
                    s: best_throughput(
                        partial(model.afd_step, n, m, stages=s, ffn_ep=ep, context=context),
                        tpot, min(att_b, 1024), n, gpus)
                    for s in (1, 2)
                }  # fmt: skip
                best_s = max(afd, key=lambda s: afd[s][0])
                predictions.append({
                    "context": context, "tpot_ms": tpot, "topology": f"{n}A{m}F",
                    "ffn_expert_parallel": ep, "gpus": gpus,
                    "colocated_tok_s_per_gpu": {k: c[0] for k, c in col.items()},
                    "colocated_batch_per_rank": {k: c[1] for k, c in col.items()},
                    "colocated_step_ms": {k: c[2] for k, c in col.items()},
                    "afd_tok_s_per_gpu": {s: afd[s][0] for s in afd},
                    "afd_batch_per_rank": {s: afd[s][1] for s in afd},
                    "afd_step_ms": {s: afd[s][2] for s in afd},
                    "best_stages": best_s,
                    "afd_over_colocated": {k: afd[best_s][0] / c[0] if c[0] else None
                                           for k, c in col.items()},
                })  # fmt: skip
    return predictions
