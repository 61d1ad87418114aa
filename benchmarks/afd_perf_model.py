#!/usr/bin/env python3
"""A performance model of AFD decode, fed by the per-role times that
benchmarks/afd_moe_decode.py measures on two GPUs: it checks itself against
those measurements, then predicts tokens per second per GPU of nA:mF
deployments against colocated data parallelism at a TPOT target.

    python3 benchmarks/afd_perf_model.py [RESULTS.json] [--layers 48] [--tpot-ms 50]

The components, each fitted to the measured points (least squares, linear in
the batch; milliseconds per step of the measured layer count, scaled by
layers for other depths):

* ``A(b) = a0 + a1 b``: the attention side's own compute for b sequences;
  ``s`` stages cost ``s a0 + a1 b`` (each stage launches every kernel again);
* ``F(T) = f0 + f1 T``: one FFN pass over T tokens with every expert; f0 is
  the weight read, paid once per pass (so once per stage);
* ``x(b) = x0 + x1 b``: the exchange (transfers) per step;
* ``tail``: final norm, logits and sampler, outside the layer loop;
* ``H(r) = h1 r``: the host's time per step for r sequences in one engine
  (scheduler, inputs, outputs), which async scheduling hides until it is the
  longer; fitted where the measured step exceeds the GPU's work.

AFD, n attention ranks, m FFN ranks, b sequences per attention rank, s stages:
each FFN rank runs T = n b / m tokens per step with all experts
(``--ffn-ep``: m FFN GPUs share the experts, as one FFN rank group with
``ffn_enable_expert_parallel`` does); step = max(GPU, H(b)), GPU = A + F + x + tail in series, or
max(s a0 + a1 b, FFN over s passes) + x + tail pipelined. Colocated data
parallel over N GPUs shards the experts (vLLM's DP for MoE), each rank with
its own engine: A(b) + (f0 + f1 N b) / N + c_dp(b) + tail, where c_dp(b) =
c0 + c1 b (the DP dispatch and combine, and DP's per-step coordination) is
calibrated at two measured batches and checked at the others. KV capacity
bounds b (``--context``: tokens of context per sequence; its attention cost,
KV bytes over ``--kv-bandwidth``, is derived, not measured here).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "afd_moe_decode.json"
GiB = 2**30


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


@dataclass
class Model:
    a0: float
    a1: float
    f0: float
    f1: float
    x0: float
    x1: float
    tail: float
    h1: float
    c0: float
    c1: float
    layers: int
    """The layer count the components were measured at."""
    kv_ms_per_token: float = 0.0
    """Attention cost per sequence per context token per step (derived)."""

    def scaled(self, layers: int, kv_ms_per_token: float) -> Model:
        k = layers / self.layers
        return Model(self.a0 * k, self.a1 * k, self.f0 * k, self.f1 * k, self.x0 * k,
                     self.x1 * k, self.tail, self.h1, self.c0 * k, self.c1 * k, layers,
                     kv_ms_per_token * layers)  # fmt: skip

    def attention(self, b: float, stages: int = 1, context: int = 0) -> float:
        return stages * self.a0 + (self.a1 + self.kv_ms_per_token * context) * b

    def ffn(self, tokens: float, stages: int = 1, share: float = 1.0) -> float:
        """``stages`` passes over ``tokens`` in all, with ``share`` of the experts."""
        return share * (stages * self.f0 + self.f1 * tokens)

    def exchange(self, b: float) -> float:
        return self.x0 + self.x1 * b

    def afd_step(self, n: int, m: int, b: float, stages: int = 1, ffn_ep: bool = False,
                 context: int = 0) -> float:  # fmt: skip
        tokens = n * b / m if not ffn_ep else n * b
        share = 1 / m if ffn_ep else 1.0
        att = self.attention(b, stages, context)
        ffn = self.ffn(tokens, stages, share)
        core = att + ffn if stages == 1 else max(att, ffn)
        return max(core + self.exchange(b) + self.tail, self.h1 * b)

    def colocated_gpu(self, gpus: int, b: float, context: int = 0) -> float:
        """A colocated rank's GPU work per step, b sequences per rank."""
        return (self.attention(b, 1, context) + self.ffn(gpus * b, 1, 1 / gpus)
                + self.c0 + self.c1 * b + self.tail)  # fmt: skip

    def colocated_step(self, gpus: int, b: float, context: int = 0) -> float:
        return max(self.colocated_gpu(gpus, b, context), self.h1 * b)


def fit(results: dict, calibrate: list[int]) -> Model:
    roles = results["role_times_ms"]["AFD"]
    batches = sorted(int(b) for b in roles)
    r = {b: roles[str(b)] for b in batches}
    ms = results["ms_per_step"]
    a0, a1 = linear_fit([(b, r[b]["attention"]) for b in batches])
    f0, f1 = linear_fit([(b, r[b]["ffn"]) for b in batches])
    x0, x1 = linear_fit([(b, r[b]["attention_exchange"] - r[b]["ffn"]) for b in batches])
    others = sorted(r[b]["other"] for b in batches)
    tail = others[0]
    host_bound = [b for b in batches if r[b]["other"] > 3 * tail]
    h1 = max((ms["AFD"][str(b)] / b for b in host_bound), default=0.0)
    layers = results["model"]["num_hidden_layers"]
    m = Model(a0, a1, f0, f1, x0, x1, tail, h1, 0.0, 0.0, layers)
    m.c0, m.c1 = linear_fit([
        (b // 2, ms["colocated DP2"][str(b)] - m.colocated_gpu(2, b // 2)) for b in calibrate
    ])  # fmt: skip
    return m


def check(model: Model, results: dict, calibrate: list[int]) -> list[tuple]:
    """(row, batch, predicted, measured, error) for every measured point."""
    ms, stages = results["ms_per_step"], results["stages"]
    rows = []
    for b in sorted(int(k) for k in ms["AFD"]):
        predicted = {
            "AFD": model.afd_step(1, 1, b),
            "AFD overlap": model.afd_step(1, 1, b, stages),
            "colocated DP2": model.colocated_step(2, b // 2),
        }
        for name, p in predicted.items():
            if name == "colocated DP2" and b in calibrate:
                continue  # c_dp was calibrated here
            measured = ms[name][str(b)]
            rows.append((name, b, p, measured, p / measured - 1))
    return rows


def best_throughput(step, tpot_ms: float, max_b: int, ranks: int, gpus: int) -> tuple:
    """(tokens/s per GPU, b, step) at the largest b per rank whose step meets
    ``tpot_ms``; (0, 0, 0) if none does."""
    best = (0.0, 0, 0.0)
    for b in range(1, max_b + 1):
        t = step(b)
        if t <= tpot_ms:
            best = max(best, (1000 * ranks * b / t / gpus, b, t))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS)
    parser.add_argument(
        "--calibrate-batches",
        type=int,
        nargs=2,
        default=[64, 256],
        help="colocated points where the GPU, not the host, sets the step",
    )
    parser.add_argument("--layers", type=int, default=48, help="of the predicted model")
    parser.add_argument("--tpot-ms", type=float, nargs="+", default=[30.0, 60.0])
    parser.add_argument("--context", type=int, nargs="+", default=[0, 2048, 8192])
    parser.add_argument("--kv-bandwidth", type=float, default=3.0e12, help="bytes/s, assumed")
    parser.add_argument("--gpu-gib", type=float, default=120.0, help="usable memory per GPU")
    parser.add_argument("--out", type=Path, help="save the predictions (JSON)")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    model = fit(results, args.calibrate_batches)
    print(f"fitted on {args.results.name} ({results['model']['num_hidden_layers']} layers, "
          f"series {results['series']}), ms per step:")  # fmt: skip
    for k, v in vars(model).items():
        print(f"  {k} = {v:.5g}")

    rows = check(model, results, args.calibrate_batches)
    print("\ncheck against the measured steps (ms): row, batch, predicted, measured, error")
    for name, b, p, meas, err in rows:
        flag = "" if abs(err) <= 0.15 else "  > 15%"
        print(f"  {name:14s} {b:4d}  {p:7.3f}  {meas:7.3f}  {100 * err:+6.1f}%{flag}")
    within = sum(abs(e) <= 0.15 for *_, e in rows)
    print(f"  {within} of {len(rows)} within 15%")

    cfg = results["model"]
    kv_bytes = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # per token per layer, bf16
    per_layer_ms = kv_bytes / args.kv_bandwidth * 1000
    big = model.scaled(args.layers, per_layer_ms)
    expert_gib = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * cfg["num_local_experts"]
    expert_gib *= 2 * args.layers / GiB
    other_gib = 4 * cfg["hidden_size"] * 4096 * 2 * args.layers / GiB + 1.2  # attention, embeddings
    topologies = [(1, 1, False), (3, 1, False), (6, 2, False), (6, 2, True), (28, 4, False),
                  (28, 4, True)]  # fmt: skip
    predictions = []
    print(f"\npredicted, {args.layers} layers, tokens/s per GPU at a TPOT target "
          f"(best batch per rank b); reading the KV of 1K context tokens costs "
          f"{per_layer_ms * 1e6 * args.layers:.1f} us per sequence per step (derived)")  # fmt: skip
    for context in args.context:
        kv_per_seq_gib = kv_bytes * args.layers * max(context, 64) / GiB
        for tpot in args.tpot_ms:
            for n, m, ep in topologies:
                gpus = n + m
                ffn_gib = expert_gib / m if ep else expert_gib
                if ffn_gib > args.gpu_gib:
                    continue
                att_b = int((args.gpu_gib - other_gib) / kv_per_seq_gib)
                col_b = int((args.gpu_gib - other_gib - expert_gib / gpus) / kv_per_seq_gib)
                colocated_step = partial(big.colocated_step, gpus, context=context)
                col = best_throughput(colocated_step, tpot, min(col_b, 1024), gpus, gpus)
                afd = {
                    s: best_throughput(
                        partial(big.afd_step, n, m, stages=s, ffn_ep=ep, context=context),
                        tpot, min(att_b, 1024), n, gpus)
                    for s in (1, 2)
                }  # fmt: skip
                best_s = max(afd, key=lambda s: afd[s][0])
                ratio = afd[best_s][0] / col[0] if col[0] else float("inf")
                predictions.append({
                    "context": context, "tpot_ms": tpot, "topology": f"{n}A{m}F",
                    "ffn_expert_parallel": ep, "gpus": gpus,
                    "colocated_tok_s_per_gpu": col[0], "colocated_batch_per_rank": col[1],
                    "afd_tok_s_per_gpu": {s: afd[s][0] for s in afd},
                    "afd_batch_per_rank": {s: afd[s][1] for s in afd},
                    "afd_over_colocated": ratio, "best_stages": best_s,
                })  # fmt: skip
                print(f"  ctx {context:5d}  TPOT {tpot:4.0f} ms  {n:2d}A{m}F"
                      f"{' EP' if ep else '   '} ({gpus:2d} GPUs): colocated "
                      f"{col[0]:7.0f} (b={col[1]:4d})  AFD serial {afd[1][0]:7.0f} "
                      f"(b={afd[1][1]:4d})  2 stages {afd[2][0]:7.0f}  AFD/colocated "
                      f"{ratio:5.2f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"model": vars(model), "check": rows,
                                        "predictions": predictions}, indent=2) + "\n")  # fmt: skip
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
