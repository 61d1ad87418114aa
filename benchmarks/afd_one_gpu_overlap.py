#!/usr/bin/env python3
"""Overlap on one GPU under MPS: colocated vLLM against AFD (ipc, both roles
on one GPU) without stages, with 2 and 3 micro-batch stages, and with an SM
split between the roles, at batches and contexts where the bound says
overlap could pay; with each row's bound beside it.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_one_gpu_overlap.py \\
        [--shape qwen3-8b | qwen3-30b-a3b] [--points 64x8192 256x2048 512x512] \\
        [--rows ...] [--sm-split 40 60] [--profile-host]

Every row runs under one private MPS daemon, on Model Runner V1 (the runner
that micro-batches) with FULL_DECODE_ONLY graphs captured at the points'
batches, dummy weights, and the same fixed KV cache, sized for the largest
point; each row's engine asks for its share of the GPU
(``vllm_afd_dev.bench.gpu_memory``, as benchmarks/afd_gpu_decode.py does),
and a row that cannot fit is refused before any runs (at 48 layers, a point
of 64 sequences of 8192 tokens needs an H200). A point ``BxL`` is B
sequences with prompts of L tokens; each point is one generation whose
full-batch decode steps are cut into windows (benchmarks/decode_timing.py):
a warm-up, then ``--repeats`` timings, printed as mean (spread).

**The bound.** Each role's work per decode step, from the model's shape:
bytes (weights read once per pass, the KV cache read by attention, the
experts a MoE batch touches under uniform routing) and FLOPs (2 per weight
per token, attention's 4 per cached key per head dim). A role alone takes
max(bytes / HBM bandwidth, FLOPs / peak). Colocated runs the roles one
after the other, so its ideal is the sum; overlapped roles on one GPU share
its bandwidth and SMs, so their ideal is max(total bytes / bandwidth, total
FLOPs / peak), with each stage reading the weights again. The bound of a row
is the first over the second: above 1 only where one role is
bandwidth-bound while the other is compute-bound (vllm_afd_dev.bench.roofline).

The AFD rows time both roles' steps (``time_steps``): attention compute,
FFN compute, exchange and the rest of the step, per point, which
benchmarks/afd_perf_model.py fits the planner to. ``--profile-host`` samples the
engine core with py-spy in one more window at batches of 256 and up, for
colocated and the AFD rows without stages: the host's time per step
(vllm_afd_dev.bench.host_profile); the row "AFD untimed" runs AFD without
``time_steps``, whose event wait at each step start would move where the
engine waits.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

from afd_gpu_decode import mps_env, with_memory
from afd_moe_decode import RoleTimes, overlap_args, recorded_step_times, with_stats_dir
from decode_timing import measure, sequence_tokens

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.gpu_memory import GpuMemoryError, gpu_total_bytes, kv_cache_bytes
from vllm_afd_dev.bench.host_profile import host_share
from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.bench.roofline import HBM_BYTES_PER_S, PEAK_FLOPS, bound, role_work
from vllm_afd_dev.bench.shapes import QWEN3_8B, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, shaped_model
from vllm_afd_dev.harness.generate import afd_engine_args
from vllm_afd_dev.harness.model_runner import NoModelRunnerV1, model_runner_v1_env

SHAPES = {  # name: (config, checkpoint whose tokenizer it takes, default points)
    # 1024x512: outside 64-512 sequences, where the bound lets stages pay.
    "qwen3-8b": (QWEN3_8B, "tiny-qwen3", ["64x8192", "512x512", "1024x512"]),
    "qwen3-30b-a3b": (
        dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS),
        "tiny-qwen3-moe",
        ["64x8192", "128x512", "256x2048", "512x1024"],
    ),
}
COLOCATED, AFD, UNTIMED = "colocated", "AFD", "AFD untimed"
MAX_BATCHED_TOKENS = 16384


def parse_point(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    return int(batch), int(context)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--points", nargs="+", help="BATCHxCONTEXT, each batch once")
    all_rows = [COLOCATED, AFD, "AFD 2 stages", "AFD 3 stages", "AFD 2 stages SM"]
    parser.add_argument("--rows", nargs="+", default=all_rows)
    parser.add_argument("--sm-split", type=int, nargs=2, default=[40, 60],
                        metavar=("ATTENTION", "FFN"), help="SM percent of the SM row")  # fmt: skip
    parser.add_argument("--decode-tokens", type=int, default=16, help="steps per window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-host", action="store_true")
    parser.add_argument("--keep-profiles", type=Path, help="where the raw py-spy samples go")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    config, tokenizer_model, default_points = SHAPES[args.shape]
    points = [parse_point(p) for p in args.points or default_points]
    batches = [b for b, _ in points]
    if len(set(batches)) != len(batches):
        raise SystemExit(f"each batch once, please ({batches}): AFD's step times are kept "
                         "per token layout, so two points of one batch would mix")  # fmt: skip
    windows = 1 + args.repeats + args.profile_host
    # The first sequences decode while the last ones prefill: room for those tokens too.
    longest = {(b, c): sequence_tokens(args.decode_tokens, windows, c)
               + -(-b * c // MAX_BATCHED_TOKENS) for b, c in points}  # fmt: skip
    kv = max(kv_cache_bytes(config, b, n) for (b, _), n in longest.items())
    engine = dict(
        dtype="bfloat16",
        attention_backend="FLASH_ATTN",
        load_format="dummy",
        seed=0,
        max_model_len=max(longest.values()),
        max_num_seqs=max(batches),
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "mode": 0,
            "cudagraph_capture_sizes": sorted(batches),
        },  # fmt: skip
    )
    afd = afd_engine_args(engine, connector="ipc", time_steps=True)
    sm = {"attention": args.sm_split[0], "ffn": args.sm_split[1]}
    rows = {
        COLOCATED: engine,
        AFD: afd,
        # Without time_steps, whose event wait at each step start moves where
        # the engine waits: for the host profile.
        UNTIMED: afd | {"afd_config": afd["afd_config"] | {"time_steps": False}},
        "AFD 2 stages": afd | overlap_args(2),
        "AFD 3 stages": afd | overlap_args(3),
        "AFD 2 stages SM": afd
        | overlap_args(2)
        | {"afd_config": afd["afd_config"] | {"mps_active_thread_percentage": sm}},
    }
    stages_of = {COLOCATED: 1, AFD: 1, UNTIMED: 1, "AFD 2 stages": 2, "AFD 3 stages": 3,
                 "AFD 2 stages SM": 2}  # fmt: skip
    unknown = set(args.rows) - set(rows)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {list(rows)}")
    try:  # every row's memory before any runs
        planned, plans = with_memory({n: (rows[n], True) for n in args.rows}, config, kv,
                                     gpu_total_bytes())  # fmt: skip
    except GpuMemoryError as e:
        raise SystemExit(f"{e}\n(Or choose --points with fewer sequences or shorter contexts, "
                         "or the qwen3-8b shape.)") from None  # fmt: skip
    rows = {name: engine_args for name, (engine_args, _) in planned.items()}
    for name, plan in plans.items():
        print(f"memory of {name!r}: {plan.describe()}", flush=True)
    try:
        v1 = model_runner_v1_env("benchmarks/afd_one_gpu_overlap.py (its rows micro-batch on V1)")
    except NoModelRunnerV1 as e:
        raise SystemExit(str(e)) from None
    env = v1 | mps_env("on")
    runs, recorded = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        base = MODELS / tokenizer_model
        model = shaped_model(Path(tmp) / f"{args.shape}-shape", config, base=base)
        for name in args.rows:
            profile = (args.keep_profiles or Path(tmp) / "profiles") / name.replace(" ", "-")
            profiled = args.profile_host and name in (COLOCATED, AFD, UNTIMED)
            stats = Path(tmp) / "stats" / name.replace(" ", "-")
            runs[name] = measure(
                name, model, with_stats_dir(rows[name], stats), batches, args.decode_tokens,
                env=env, repeats=args.repeats, contexts=[c for _, c in points],
                profile_dir=profile if profiled else None, timeout_s=1800,
            )  # fmt: skip
            if name not in (COLOCATED, UNTIMED):
                recorded[name] = recorded_step_times(stats)
        hosts = {
            name: {b: (host_share(Path(p["path"])), p["ms_per_step"])
                   for b, p in runs[name].profiles.items() if b >= 256}
            for name in runs if runs[name].profiles
        }  # fmt: skip

    ms = {name: run.ms_per_step for name, run in runs.items()}
    print(f"\n{args.shape} shape, dummy weights, one GPU under MPS, ms per decode step, "
          f"mean (spread) of {args.repeats}; beside each AFD row: colocated / row "
          "(measured) | its bound")  # fmt: skip
    print("batch context  " + "  ".join(f"{n:>30s}" for n in runs))
    results = []
    for b, c in points:
        cells = []
        for name, run in runs.items():
            cell = f"{ms[name][b]:8.3f} ({run.spread(b):5.1%})"
            if name != COLOCATED and COLOCATED in ms:
                ideal = bound(config, b, c, stages_of[name])
                cell += f" {ms[COLOCATED][b] / ms[name][b]:4.2f}|{ideal:4.2f}"
            cells.append(f"{cell:>30s}")
        print(f"{b:5d} {c:7d}  " + "  ".join(cells))
        attention, ffn = role_work(config, b, c)
        results.append({
            "batch": b, "context": c,
            "ms_per_step": {n: runs[n].repeats[b] for n in runs},
            "ideal_ms": {"attention": attention.ms(), "ffn": ffn.ms()},
            "bound": {n: bound(config, b, c, stages_of[n]) for n in runs if n != COLOCATED},
        })  # fmt: skip

    roles = {}
    print("\nper-step times (ms) of the AFD rows: each role's compute, the attention "
          "side's exchange, the rest of the step; beside them the roofline ideal")  # fmt: skip
    print(
        "row              batch context  attention    FFN  att.exch  other  | ideal att  ideal FFN"
    )
    for name in runs:
        if name in (COLOCATED, UNTIMED):
            continue
        roles[name] = {}
        for b, c in points:
            t = RoleTimes.from_step_times(recorded[name], b, ms[name][b])
            roles[name][b] = asdict(t)
            attention, ffn = role_work(config, b, c)
            print(f"{name:15s}  {b:5d} {c:7d}  {t.attention:9.3f}  {t.ffn:5.3f}  "
                  f"{t.attention_exchange:8.3f}  {t.other:5.3f}  | {attention.ms():9.3f}  "
                  f"{ffn.ms():9.3f}")  # fmt: skip

    host = {}
    if hosts:
        print("\nhost time per step of the engine core (py-spy, one more window): share of "
              "its busy samples not waiting for the GPU, times that window's step")  # fmt: skip
        for name, by_batch in hosts.items():
            for b, (share, step_ms) in sorted(by_batch.items()):
                host.setdefault(name, {})[b] = {
                    "host_ms": share.host_fraction * step_ms, "step_ms": step_ms,
                    **asdict(share),
                }  # fmt: skip
                print(f"  {name:10s} batch {b:4d}: {share.host_fraction * step_ms:7.3f} ms of a "
                      f"{step_ms:.3f} ms step ({share.host} host, {share.afd} of them in AFD's "
                      f"code, {share.gpu_wait} GPU-wait, {share.idle} idle samples); top: "
                      + ", ".join(f"{x} {f:.0%}" for x, f in share.top_host_leaves[:5])
                      )  # fmt: skip
        for name in (AFD, UNTIMED):
            for b in sorted(set(host.get(COLOCATED, {})) & set(host.get(name, {}))):
                ratio = host[name][b]["host_ms"] / host[COLOCATED][b]["host_ms"]
                print(f"  {name} / colocated host time at batch {b}: {ratio:.2f} (target <= 1.1)")

    save_results(
        args.out or RESULTS / f"afd_one_gpu_overlap_{args.shape}.json",
        device=torch.cuda.get_device_name(),
        model={"shape": args.shape, **config, "weights": "dummy"},
        engine_args={n: rows[n] for n in runs},
        memory={name: plan.as_dict() for name, plan in plans.items()},
        env=env | {"CUDA_MPS_PIPE_DIRECTORY": "(private daemon)"},
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        hbm_bytes_per_s=HBM_BYTES_PER_S,
        peak_flops=PEAK_FLOPS,
        points=results,
        role_times_ms=roles,
        host=host,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
