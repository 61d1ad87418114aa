# SPDX-License-Identifier: Apache-2.0
"""The ``vllm afd-plan`` subcommand: the A:F split, batch and stages that
serve a model best on given GPUs, against colocated DP+EP
(``vllm.afd.plan``)."""

from __future__ import annotations

import argparse
import json

from vllm.entrypoints.cli.types import CLISubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

DESCRIPTION = """Plan an Attention-FFN Disaggregation (AFD) deployment: for
MODEL (a local config.json, a directory holding one, or a named shape) on
--gpus GPUs of a preset, find the split into attention and FFN GPUs, the
batch per attention rank and the micro-batch stages that give the most
output tokens/s per GPU within --tpot-ms, and compare with colocated
data-parallel + expert-parallel serving on the same GPUs. Without --profile
the GPU's rates are roofline defaults from its preset; --calibrate measures
them on this machine's GPU (minutes) and saves a profile."""

# Flag -> (GPUSpec field, factor to SI units).
GPU_FLAGS = {
    "hbm_tbps": ("hbm_bytes_per_s", 1e12),
    "memory_gib": ("memory_gib", 1.0),
    "link_gbps": ("link_bytes_per_s", 1e9),
    "link_latency_us": ("link_latency_s", 1e-6),
    "domain_gpus": ("domain_gpus", 1),
    "scaleout_gbps": ("scaleout_bytes_per_s", 1e9),
    "scaleout_latency_us": ("scaleout_latency_s", 1e-6),
    "host_sync_us": ("host_sync_s", 1e-6),
}


def _point(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    return int(batch), int(context)


def run_plan(args: argparse.Namespace) -> None:
    from vllm.afd.plan.calibrate import fit_rates
    from vllm.afd.plan.cost import CostModel
    from vllm.afd.plan.hardware import PRESETS
    from vllm.afd.plan.rates import Profile, Rates
    from vllm.afd.plan.report import as_dict, as_text
    from vllm.afd.plan.search import Target, plan
    from vllm.afd.plan.shapes import load_shape

    gpu = PRESETS[args.gpu].with_overrides(
        **{
            field: None if getattr(args, flag) is None else getattr(args, flag) * unit
            for flag, (field, unit) in GPU_FLAGS.items()
        }
    )
    flops = {d: v * 1e12 for d, v in (("bf16", args.bf16_tflops), ("fp8", args.fp8_tflops)) if v}
    if flops:
        gpu = gpu.with_overrides(flops={**gpu.flops, **flops})
    shape = load_shape(args.model)
    cost = CostModel(shape, gpu, Rates.roofline(gpu, "fp8" if shape.weight_bytes == 1 else "bf16"))
    if args.calibrate:
        import dataclasses

        import torch
        from vllm.afd.plan.calibrate import rows_as_dicts
        from vllm.afd.plan.calibration_budget import calibration_budget
        from vllm.afd.plan.measure import (
            DECODE_TOKENS,
            DEFAULT_POINTS,
            gpu_memory_bytes,
            measure_samples,
        )
        from vllm.afd.plan.shapes import layers_override, load_config

        points = tuple(_point(p) for p in args.calibrate_points or ()) or DEFAULT_POINTS
        free, total = gpu_memory_bytes()
        budget = calibration_budget(
            lambda n: shape if n is None else load_shape(args.model, n),
            points,
            DECODE_TOKENS,
            free,
            total,
            args.calibrate_layers,
        )
        print(budget.describe(), flush=True)
        cut = budget.layers < budget.model_layers
        samples = measure_samples(
            args.model,
            points,
            budget.engine_args(),
            layers_override(load_config(args.model), budget.layers) if cut else None,
        )
        device = torch.cuda.get_device_name()
        measured = load_shape(args.model, budget.layers) if cut else shape
        rates, rows = fit_rates(
            dataclasses.replace(cost, shape=measured), samples, f"calibrated on {device}"
        )
        profile = Profile(device, args.model, rates, rows_as_dicts(rows))
        path = args.profile or "afd-plan-profile.json"
        profile.save(path)
        for r in rows:
            print(
                f"calibration: batch {r.batch:4d} context {r.context:6.0f} {r.role:9s} "
                f"measured {r.measured_ms:8.3f} ms  fitted {r.fitted_ms:8.3f}  "
                f"({100 * r.error:+.1f}%)"
            )
        print(f"saved the profile to {path}")
        cost = dataclasses.replace(cost, rates=rates)
    elif args.profile:
        import dataclasses

        cost = dataclasses.replace(cost, rates=Profile.load(args.profile).rates)
    target = Target(
        args.gpus, args.tpot_ms / 1e3, args.context, args.concurrency, tuple(args.stages)
    )
    result = plan(cost, target)
    print(json.dumps(as_dict(result, cost), indent=2) if args.json else as_text(result, cost))


class AFDPlanSubcommand(CLISubcommand):
    name = "afd-plan"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        run_plan(args)

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> FlexibleArgumentParser:
        from vllm.afd.plan.hardware import PRESETS
        from vllm.afd.plan.shapes import NAMED

        parser = subparsers.add_parser(
            self.name,
            help="Plan an AFD deployment against colocated DP+EP.",
            description=DESCRIPTION,
            usage="vllm afd-plan --model MODEL [--gpu H200] [--gpus 8] [--tpot-ms 50] [options]",
        )
        parser.add_argument(
            "--model",
            required=True,
            help=f"a config.json, its directory, or one of: {', '.join(NAMED)}",
        )
        parser.add_argument("--gpu", choices=list(PRESETS), default="H200")
        parser.add_argument("--gpus", type=int, default=8, help="GPUs of the deployment")
        parser.add_argument("--tpot-ms", type=float, default=50.0, help="time per output token")
        parser.add_argument(
            "--context",
            type=float,
            default=2048,
            help="mean context (KV tokens) of a decoding sequence",
        )
        parser.add_argument(
            "--concurrency", type=int, help="sequences in flight in the whole deployment, if capped"
        )
        parser.add_argument(
            "--stages",
            type=int,
            nargs="+",
            default=[1, 2, 3],
            help="AFD micro-batch stages to consider",
        )
        parser.add_argument("--json", action="store_true", help="print the plan as JSON")
        spec = parser.add_argument_group("GPU overrides (the preset's specification otherwise)")
        for flag in GPU_FLAGS:
            spec.add_argument("--" + flag.replace("_", "-"), type=float)
        spec.add_argument("--bf16-tflops", type=float)
        spec.add_argument("--fp8-tflops", type=float)
        cal = parser.add_argument_group("calibration")
        cal.add_argument("--profile", help="a calibrated profile to plan with (or to write)")
        cal.add_argument(
            "--calibrate",
            action="store_true",
            help="measure each role on this GPU (MODEL: a model vLLM loads; dummy "
            "weights), fit the rates, save them to --profile, then plan",
        )
        cal.add_argument(
            "--calibrate-points",
            nargs="+",
            metavar="BATCHxCONTEXT",
            help="points to measure, each batch once",
        )
        cal.add_argument(
            "--calibrate-layers",
            type=int,
            help="run the model cut to this depth (one that does not fit one GPU)",
        )
        return parser


def cmd_init() -> list[CLISubcommand]:
    return [AFDPlanSubcommand()]
