#!/usr/bin/env python3
"""The planner (``vllm afd-plan``, vllm.afd.plan) against this project's own
GPU measurements: fits its rates to stored per-role times, as ``vllm
afd-plan --calibrate`` fits them to the ones it measures, then predicts the
one-GPU 1A1F decode steps that took no part in the fit.

    python3 benchmarks/afd_perf_model.py [--role-times FILE] [--one-gpu-steps FILE] \\
        [--profile OUT.json]
    python3 benchmarks/afd_perf_model.py --calibrated PROFILE --one-gpu-steps FILE --gpu H100

``--role-times``: benchmarks/afd_one_gpu_overlap.py's results (per-role
times at the model's depth, one GPU under MPS); ``--one-gpu-steps``:
benchmarks/afd_gpu_decode.py's (decode steps, short prompts). The saved
profile plans with ``vllm afd-plan --profile OUT.json``. ``--calibrated``
predicts the steps with the rates of a profile that ``vllm afd-plan
--calibrate`` measured on the GPU instead (no role times are fitted).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from vllm.afd.plan.calibrate import RoleSample, fit_rates, rows_as_dicts
from vllm.afd.plan.cost import CostModel
from vllm.afd.plan.hardware import PRESETS
from vllm.afd.plan.rates import Profile, Rates
from vllm.afd.plan.shapes import ModelShape

from vllm_afd_dev.bench.results import RESULTS

SHORT_PROMPT = 16
"""Prompt tokens of benchmarks/decode_timing.py's runs without contexts."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--role-times", type=Path, default=RESULTS / "afd_one_gpu_overlap_qwen3-30b-a3b.json"
    )
    parser.add_argument(
        "--one-gpu-steps", type=Path, default=RESULTS / "afd_gpu_decode_qwen3-30b-a3b.json"
    )
    parser.add_argument("--gpu", choices=list(PRESETS), default="H200")
    parser.add_argument("--profile", type=Path, help="save the fitted rates as a profile")
    parser.add_argument(
        "--calibrated",
        type=Path,
        help="predict with this profile of `vllm afd-plan --calibrate` instead of fitting",
    )
    args = parser.parse_args()
    steps = json.loads(args.one_gpu_steps.read_text())
    if args.calibrated:
        profile = Profile.load(args.calibrated)
        shape = ModelShape.from_config(steps["model"]["shape"], steps["model"])
        print(f"rates calibrated on {profile.gpu} ({args.calibrated.name}): {profile.rates}")
        predict_steps(CostModel(shape, PRESETS[args.gpu], profile.rates), steps, args)
        return 0
    role_file = json.loads(args.role_times.read_text())
    shape = ModelShape.from_config(role_file["model"]["shape"], role_file["model"])
    gpu = PRESETS[args.gpu]
    cost = CostModel(shape, gpu, Rates.roofline(gpu, "bf16"))
    rates, rows = fit_rates(cost, RoleSample.from_benchmark(role_file), args.role_times.name)
    print(f"rates fitted to {args.role_times.name}:")
    for name, value in vars(rates).items():
        print(f"  {name} = {value:.5g}" if isinstance(value, float) else f"  {name} = {value}")
    print("fit, ms per step: batch, context, role, measured, fitted, error")
    for r in rows:
        print(
            f"  {r.batch:4d} {r.context:6.0f} {r.role:9s} {r.measured_ms:8.3f} "
            f"{r.fitted_ms:8.3f} {100 * r.error:+6.1f}%"
        )
    predict_steps(replace(cost, rates=rates), steps, args)
    if args.profile:
        Profile(role_file.get("device", args.gpu), shape.name, rates, rows_as_dicts(rows)).save(
            args.profile
        )
        print(f"saved {args.profile}")
    return 0


def predict_steps(cost: CostModel, steps: dict, args: argparse.Namespace) -> None:
    context = SHORT_PROMPT + steps["decode_tokens"] / 2
    print(f"predicted one-GPU 1A1F steps ({args.one_gpu_steps.name}, not fitted):")
    for b, ms in steps["ms_per_output_token"]["AFD graphs, MPS on"].items():
        measured = sum(ms) / len(ms)
        predicted = 1e3 * cost.shared_gpu_afd_step(int(b), context)
        print(
            f"  batch {b:>4}: {predicted:7.2f} ms against {measured:7.2f} "
            f"({100 * (predicted / measured - 1):+.1f}%)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
