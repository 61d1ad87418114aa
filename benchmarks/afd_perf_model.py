#!/usr/bin/env python3
"""A performance model of AFD decode: each role's compute measured at the
model's full depth on one GPU, the exchange between the roles measured on two
GPUs. It checks itself against every measured decode step, then predicts
tokens per second per GPU of nA:mF deployments against colocated data
parallelism at a TPOT target.

    python3 benchmarks/afd_perf_model.py [--tpot-ms 30 60] [--context 0 2048 8192] \\
        [--out benchmarks/results/afd_perf_model.json]

Inputs, in benchmarks/results/ (an option replaces each):

* ``--role-times`` (afd_one_gpu_overlap_qwen3-30b-a3b.json): the AFD row's
  per-role times per step at the full 48 layers, one H200 under MPS, at
  points of batch and context. Fits attention and FFN compute, and the
  exchange and tail of two roles that share one GPU.
* ``--two-gpu`` (afd_moe_decode.json): the same shape cut to 8 layers on two
  H200s over nccl. Fits the exchange between GPUs, the tail, the host's time
  per sequence and colocated DP's own cost; its per-role times and steps are
  checked against the full-depth fit.
* ``--one-gpu-steps`` (afd_gpu_decode_qwen3-30b-a3b.json): decode steps at
  full depth on one GPU under MPS, AFD and colocated, short prompts, batch
  1-256. Checked, not fitted.
* ``--form-check`` (afd_one_gpu_overlap_qwen3-8b.json): another shape's
  per-role times; the attention form fitted to them gives the KV read
  bandwidth it implies, beside the main fit's.

The model, its components and how it predicts: vllm_afd_dev.bench.perf_model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from vllm_afd_dev.bench.perf_model import (
    check,
    fit,
    fit_attention,
    kv_read_bandwidth,
    predict,
    role_time_points,
)
from vllm_afd_dev.bench.results import RESULTS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role-times", type=Path,
                        default=RESULTS / "afd_one_gpu_overlap_qwen3-30b-a3b.json")  # fmt: skip
    parser.add_argument("--two-gpu", type=Path, default=RESULTS / "afd_moe_decode.json")
    parser.add_argument("--one-gpu-steps", type=Path,
                        default=RESULTS / "afd_gpu_decode_qwen3-30b-a3b.json")  # fmt: skip
    parser.add_argument("--form-check", type=Path,
                        default=RESULTS / "afd_one_gpu_overlap_qwen3-8b.json")  # fmt: skip
    parser.add_argument(
        "--calibrate-batches",
        type=int,
        nargs=2,
        default=[64, 256],
        help="two-GPU colocated points where the GPU, not the host, sets the step",
    )
    parser.add_argument("--tpot-ms", type=float, nargs="+", default=[30.0, 60.0])
    parser.add_argument("--context", type=int, nargs="+", default=[0, 2048, 8192])
    parser.add_argument("--gpu-gib", type=float, default=120.0, help="usable memory per GPU")
    parser.add_argument("--out", type=Path, help="save the fit, check and predictions (JSON)")
    args = parser.parse_args()
    inputs = {"role_times": args.role_times, "two_gpu": args.two_gpu,
              "one_gpu_steps": args.one_gpu_steps, "form_check": args.form_check}  # fmt: skip
    data = {name: json.loads(path.read_text()) for name, path in inputs.items()}
    model, one_gpu = fit(data["role_times"], data["two_gpu"], args.calibrate_batches)
    cfg = data["role_times"]["model"]
    print(f"fitted, ms per decode step of {model.layers} layers (b sequences, c context "
          f"tokens, T tokens):")  # fmt: skip
    for name, value in vars(model).items():
        print(f"  {name} = {value:.5g}" if isinstance(value, float) else f"  {name} = {value}")
    # c_dp's c1 as measured at the two-GPU depth, not grown with the layers.
    depth = data["two_gpu"]["model"]["num_hidden_layers"]
    c1_per_step = replace(model.scaled(depth), dp_c1_per_layer=False).scaled(model.layers)
    print(f"  c1 once per step (as measured at {depth} layers): {c1_per_step.c1:.5g}")
    print(f"  one GPU under MPS: x0 = {one_gpu.x0:.5g}, x1 = {one_gpu.x1:.5g}, "
          f"tail = {one_gpu.tail:.5g}")  # fmt: skip
    form_cfg = data["form_check"]["model"]
    form_kv = fit_attention(role_time_points(data["form_check"]))[2]
    bandwidth = {cfg["shape"]: kv_read_bandwidth(model.a_kv, cfg),
                 form_cfg["shape"]: kv_read_bandwidth(form_kv, form_cfg)}  # fmt: skip
    print("  KV read the attention fit implies: "
          + ", ".join(f"{s} {bw / 1e12:.2f} TB/s" for s, bw in bandwidth.items()))  # fmt: skip

    rows = check(model, one_gpu, data["role_times"], data["two_gpu"], data["one_gpu_steps"],
                 args.calibrate_batches)  # fmt: skip
    print("\ncheck (ms per step): source, row, batch, context, predicted, measured, error "
          "(* in sample)")  # fmt: skip
    for r in rows:
        print(f"  {r.source:24s} {r.row:13s} {r.batch:4d} {r.context:5d}  {r.predicted:7.3f}  "
              f"{r.measured:7.3f}  {100 * r.error:+6.1f}%{' *' if r.fitted else ''}")  # fmt: skip
    predicted = [r for r in rows if not r.fitted]
    for limit in (0.10, 0.15):
        within = sum(abs(r.error) <= limit for r in predicted)
        print(f"  out of sample: {within} of {len(predicted)} within {100 * limit:.0f}%")

    predictions = predict(model, c1_per_step, cfg, args.context, args.tpot_ms, args.gpu_gib)
    print(f"\npredicted, {model.layers} layers, tokens/s per GPU at a TPOT target (best batch "
          f"per rank b; colocated with c1 per layer / per step); reading 1K context "
          f"tokens costs {model.a_kv * 1e6:.1f} us per sequence per step")  # fmt: skip
    for p in predictions:
        afd, b = p["afd_tok_s_per_gpu"], p["afd_batch_per_rank"]
        col, col_b = p["colocated_tok_s_per_gpu"].values(), p["colocated_batch_per_rank"].values()
        ratio = [r if r is not None else float("inf") for r in p["afd_over_colocated"].values()]
        print(f"  ctx {p['context']:5d}  TPOT {p['tpot_ms']:3.0f} ms  {p['topology']:5s}"
              f"{' EP' if p['ffn_expert_parallel'] else '   '} ({p['gpus']:2d} GPUs): colocated "
              + " / ".join(f"{c:5.0f} (b={cb:4d})" for c, cb in zip(col, col_b, strict=True))
              + f"  AFD serial {afd[1]:5.0f} (b={b[1]:4d})  2 stages {afd[2]:5.0f} "
              f"(b={b[2]:4d})  AFD/colocated {ratio[0]:4.2f} / {ratio[1]:4.2f}")  # fmt: skip
    if args.out:
        saved = {
            "inputs": {name: {"file": path.name, "series": data[name].get("series")}
                       for name, path in inputs.items()},
            "model": vars(model),
            "one_gpu_model": {"x0": one_gpu.x0, "x1": one_gpu.x1, "tail": one_gpu.tail},
            "c1_per_step": c1_per_step.c1,
            "kv_read_bytes_per_s": bandwidth,
            "check": [asdict(r) | {"error": r.error} for r in rows],
            "predictions": predictions,
        }  # fmt: skip
        args.out.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
