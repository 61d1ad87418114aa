#!/usr/bin/env python3
"""Decode throughput per GPU of a MoE model on two GPUs: colocated data
parallel 2, AFD 1A1F, and AFD 1A1F with micro-batch overlap, from one run,
with each role's own compute and exchange per step.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_moe_decode.py \\
        [--layers 8] [--batches 64 128 256 512] [--stages 2] [--repeats 3]

The model has Qwen3-30B-A3B's dimensions (128 experts, top-8, hidden 2048)
with fewer layers and dummy weights, which are fine for timing. AFD puts the
attention engine on GPU 0 and its FFN rank on GPU 1 (nccl connector);
colocated runs vLLM's offline data parallel, one full engine per GPU, each
decoding half the batch. All rows run Model Runner V1 (the runner that
micro-batches; vLLM 0.34 removed it, and there the benchmark refuses to
run) with FULL_DECODE_ONLY graphs; ``--compile`` adds
torch.compile (slower start). The batch is the number of sequences decoding
at once in the whole deployment; throughput per GPU is output tokens per
second over the two GPUs. Each engine has its GPU to itself and sizes its KV
cache from its profile: its ``gpu_memory_utilization`` gives it all of the
GPU but a margin (``vllm_afd_dev.bench.gpu_memory``), and a deployment whose
weights and least KV cache cannot fit its GPUs is refused before any runs.

Each point is ``--repeats`` generations, printed as mean and spread. The AFD
rows run with ``time_steps``: both roles split every decode step into their
own compute and their exchange (CUDA events in the graphs), which they
record at shutdown in ``stats_dir`` (``StepRecord``). From those:

* exchange cost ``x``: in the AFD row the roles run in series, so the
  attention side's exchange is the FFN's compute plus the transfers;
  ``x`` = attention exchange - FFN compute;
* ``other``: the part of the step outside the layer loop (final norm,
  logits, sampler, host gaps), which no overlap can hide;
* serial sum = attention + FFN + x + other; pipelining bound =
  max(attention, FFN) + x + other, with each row's own compute times
  (an overlapped FFN runs one pass per stage).

Saves everything (JSON), for docs/performance.md.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from decode_timing import measure, sequence_tokens

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.gpu_memory import (
    GpuMemoryError,
    gpu_total_bytes,
    kv_cache_bytes,
    own_gpus_memory,
)
from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.bench.shapes import QWEN3_30B_A3B, shaped_model
from vllm_afd_dev.harness.generate import afd_engine_args, ffn_weight_bytes
from vllm_afd_dev.harness.model_runner import NoModelRunnerV1, model_runner_v1_env

KV_CACHE_GIB = r"Available KV cache memory: ([\d.]+) GiB"
FFN_PEAK_MIB = r"AFD FFN group rank 0 of \d+ on \S+: peak device memory ([\d.]+) MiB"
GiB = 2**30
COLOCATED, AFD, OVERLAP = "colocated DP2", "AFD", "AFD overlap"
TARGETS = {  # judged at --judge-batch
    "overlap speedup (AFD / AFD overlap step)": 1.3,
    "AFD overlap per GPU / colocated DP2 per GPU": 1.0,
}
BOUND_TARGET = 1.15
"""AFD overlap step / its pipelining bound, at most."""


MAX_MODEL_LEN = 1024
REMEDIES = "fewer --layers, a smaller largest batch (--batches), or GPUs with more memory"


def engine(capture_sizes: list[int], compile: bool) -> dict:
    """Engine arguments without memory settings (``with_own_gpus_memory``)."""
    graphs = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": capture_sizes}
    return dict(
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(capture_sizes),
        compilation_config=graphs | ({} if compile else {"mode": 0}),
        seed=0,
    )


def with_own_gpus_memory(
    configs: dict[str, tuple[dict, int]], shape: dict, decode_tokens: int
) -> tuple[dict[str, tuple[dict, int]], dict[str, list]]:
    """``configs`` (name: (engine arguments, DP size)) with each engine's
    memory settings, every process on a GPU of its own, and each row's
    plans; refuses, before any runs, a row that cannot fit."""
    total = gpu_total_bytes()
    planned, plans = {}, {}
    for name, (engine_args, dp) in configs.items():
        sequences = engine_args["max_num_seqs"]
        kv = kv_cache_bytes(shape, sequences, sequence_tokens(decode_tokens), MAX_MODEL_LEN)
        try:
            memory, plans[name] = own_gpus_memory(total, shape, engine_args, kv, dp, REMEDIES)
        except GpuMemoryError as e:
            raise SystemExit(f"the row {name!r}: {e}") from None
        planned[name] = (engine_args | memory, dp)
        for plan in plans[name]:
            print(f"memory of {name!r}: {plan.describe()}", flush=True)
    return planned, plans


def overlap_args(stages: int) -> dict:
    """vLLM's micro-batching for ``stages`` stages, on every batch here."""
    split = {"enable_dbo": True} if stages == 2 else {"ubatch_size": stages}
    return split | {"dbo_decode_token_threshold": 2 * stages}


@dataclass
class RoleTimes:
    """One AFD row's per-step times at one batch (ms)."""

    attention: float
    """Attention side's compute in the layer loop (embedding and attention)."""
    attention_exchange: float
    ffn: float
    """FFN side's compute."""
    ffn_exchange: float
    other: float
    """Step time outside the attention side's layer loop."""

    @classmethod
    def from_step_times(cls, recorded: RecordedTimes, batch: int, step_ms: float) -> RoleTimes:
        """From both roles' recorded step times (``recorded_step_times``)."""

        def replayed(who: str):
            found = [
                t for t in recorded[who] if t.kind == "replay" and sum(map(sum, t.layout)) == batch
            ]
            if len(found) != 1:
                raise SystemExit(
                    f"{who}: expected the times of one replayed layout of {batch} tokens, "
                    f"found {found}; did the decode steps run as graphs?"
                )
            return found[0]

        a, f = replayed(ATTENTION_RANK), replayed(FFN_RANK)
        if a.layout != f.layout or a.steps != f.steps:
            raise SystemExit(f"the roles timed different steps: {a} / {f}")
        other = step_ms - a.compute_ms - a.exchange_ms
        if other < 0:
            raise SystemExit(f"batch {batch}: the layer loop ({a.compute_ms + a.exchange_ms:.3f} "
                             f"ms) is longer than the step ({step_ms:.3f} ms)")  # fmt: skip
        return cls(a.compute_ms, a.exchange_ms, f.compute_ms, f.exchange_ms, other)


ATTENTION_RANK, FFN_RANK = "attention rank 0", "FFN rank 0"
RecordedTimes = dict[str, list]
"""Each role's step times by layout (``LayoutTimes``), by rank name."""


def with_stats_dir(engine_args: dict, stats_dir: Path) -> dict:
    """An AFD row's engine arguments, its ranks recording their step counters
    and times into ``stats_dir`` at shutdown; a colocated row's unchanged."""
    if "afd_config" not in engine_args:
        return engine_args
    return engine_args | {"afd_config": engine_args["afd_config"] | {"stats_dir": str(stats_dir)}}


def recorded_step_times(stats_dir: Path) -> RecordedTimes:
    """The step times both roles of a timed AFD row recorded (``time_steps``)."""
    from vllm.distributed.afd_transfer.step_stats import StepRecord

    return {who: StepRecord.read(stats_dir, who).step_times for who in (ATTENTION_RANK, FFN_RANK)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="of Qwen3-30B-A3B's 48")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--judge-batch", type=int, default=256)
    parser.add_argument("--stages", type=int, default=2, help="of the overlap row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gate-on-attention", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile as well (slower)")
    parser.add_argument(
        "--untimed",
        action="store_true",
        help="also run both AFD rows without time_steps, to show what the timing costs",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_moe_decode.json")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs: AFD's two roles and colocated DP 2 use one each")
    try:
        v1 = model_runner_v1_env("benchmarks/afd_moe_decode.py (its overlap row micro-batches)")
    except NoModelRunnerV1 as e:
        raise SystemExit(str(e)) from None
    colocated_args = engine([b // 2 for b in args.batches], args.compile)
    afd_args = afd_engine_args(
        engine(args.batches, args.compile),
        connector="nccl",
        compute_gate_on_attention=args.gate_on_attention,
        time_steps=True,
    )
    configs = {  # name: (engine arguments, DP size)
        COLOCATED: (colocated_args, 2),
        AFD: (afd_args, 1),
        OVERLAP: (afd_args | overlap_args(args.stages), 1),
    }
    if args.untimed:
        for name in (AFD, OVERLAP):
            timed_args = configs[name][0]
            untimed = timed_args | {"afd_config": timed_args["afd_config"] | {"time_steps": False}}
            configs[f"{name} untimed"] = (untimed, 1)
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    configs, plans = with_own_gpus_memory(configs, shape, args.decode_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = MODELS / "tiny-qwen3-moe"
        model = shaped_model(Path(tmp) / "qwen3-30b-a3b-shape", shape, base=tiny)
        stats = {name: Path(tmp) / "stats" / f"row{i}" for i, name in enumerate(configs)}
        runs = {
            name: measure(name, model, with_stats_dir(engine_args, stats[name]), args.batches,
                          args.decode_tokens, dp_size=dp, env=v1, repeats=args.repeats)
            for name, (engine_args, dp) in configs.items()
        }  # fmt: skip
        recorded = {name: recorded_step_times(stats[name]) for name in (AFD, OVERLAP)}
    ms = {name: run.ms_per_step for name, run in runs.items()}
    roles = {
        name: {b: RoleTimes.from_step_times(recorded[name], b, ms[name][b]) for b in args.batches}
        for name in (AFD, OVERLAP)
    }
    print(f"\nQwen3-30B-A3B shape, {args.layers} layers, dummy weights, 2 GPUs, "
          f"{args.stages}-stage overlap; ms per decode step, mean (spread) of "
          f"{args.repeats}")  # fmt: skip
    print("batch  " + "  ".join(f"{n:>18s}" for n in ms) + "  colocated/AFD  AFD/overlap")
    for b in args.batches:
        cells = "  ".join(f"{ms[n][b]:9.3f} ({100 * runs[n].spread(b):4.1f}%)" for n in ms)
        print(f"{b:5d}  {cells}  {ms[COLOCATED][b] / ms[AFD][b]:13.2f}  "
              f"{ms[AFD][b] / ms[OVERLAP][b]:11.2f}")  # fmt: skip

    bounds: dict[str, dict[int, dict[str, float]]] = {}
    print("\nper-step times (ms): each role's compute, exchange cost x, the rest of the step")
    print("row          batch  attention    FFN      x  other  serial sum  bound  step  step/bound")
    for name in (AFD, OVERLAP):
        bounds[name] = {}
        for b in args.batches:
            t = roles[name][b]
            x = roles[AFD][b].attention_exchange - roles[AFD][b].ffn
            if x < 0:
                raise SystemExit(f"batch {b}: the attention side's exchange is shorter than the "
                                 f"FFN's compute in the serial run ({roles[AFD][b]}): the "
                                 "timeline is wrong")  # fmt: skip
            serial = t.attention + t.ffn + x + t.other
            bound = max(t.attention, t.ffn) + x + t.other
            bounds[name][b] = {"exchange": x, "serial_sum": serial, "bound": bound}
            print(f"{name:11s}  {b:5d}  {t.attention:9.3f}  {t.ffn:5.3f}  {x:5.3f}  "
                  f"{t.other:5.3f}  {serial:10.3f}  {bound:5.3f}  {ms[name][b]:5.3f}  "
                  f"{ms[name][b] / bound:10.2f}")  # fmt: skip

    j = args.judge_batch
    judged = {}
    if j in args.batches:
        per_gpu = {n: 1000 * j / ms[n][j] / 2 for n in ms}
        judged = {
            "overlap speedup (AFD / AFD overlap step)": ms[AFD][j] / ms[OVERLAP][j],
            "AFD overlap per GPU / colocated DP2 per GPU": per_gpu[OVERLAP] / per_gpu[COLOCATED],
            "AFD overlap step / its bound": ms[OVERLAP][j] / bounds[OVERLAP][j]["bound"],
            "AFD overlap bound per GPU / colocated DP2 per GPU": ms[COLOCATED][j]
            / bounds[OVERLAP][j]["bound"],
            "AFD bound without stages per GPU / colocated DP2 per GPU": ms[COLOCATED][j]
            / (max(roles[AFD][j].attention, roles[AFD][j].ffn)
               + bounds[AFD][j]["exchange"] + roles[AFD][j].other),
        }  # fmt: skip
        print(f"\njudged at batch {j}:")
        for what, value in judged.items():
            target = TARGETS.get(what)
            verdict = ""
            if target is not None:
                verdict = f"  (target >= {target}: {'met' if value >= target else 'NOT met'})"
            elif what.endswith("its bound"):
                ok = value <= BOUND_TARGET
                verdict = f"  (target <= {BOUND_TARGET}: {'met' if ok else 'NOT met'})"
            print(f"  {what}: {value:.2f}{verdict}")

    mem = {
        "colocated weights GiB (each rank)": runs[COLOCATED].weight_bytes[0] / GiB,
        "colocated KV cache GiB (each rank)": runs[COLOCATED].log_values(KV_CACHE_GIB)[0],
        "AFD attention weights GiB": runs[AFD].weight_bytes[0] / GiB,
        "AFD attention KV cache GiB": runs[AFD].log_values(KV_CACHE_GIB)[0],
        "AFD FFN weights GiB": sum(ffn_weight_bytes(runs[AFD].log)) / GiB,
        "AFD FFN peak GiB": runs[AFD].log_values(FFN_PEAK_MIB)[0] / 1024,
    }
    print("\nmemory: " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items()))
    save_results(
        args.out,
        device=torch.cuda.get_device_name(),
        model={"architecture": "Qwen3MoeForCausalLM", **shape, "weights": "dummy"},
        engine_args={n: {"engine": c[0], "dp_size": c[1], "env": v1} for n, c in configs.items()},
        stages=args.stages,
        decode_tokens=args.decode_tokens,
        repeats={name: run.repeats for name, run in runs.items()},
        ms_per_step=ms,
        role_times_ms={n: {b: asdict(t) for b, t in r.items()} for n, r in roles.items()},
        bounds_ms=bounds,
        judged_at_batch={j: judged} if judged else {},
        memory=mem,
        memory_plans={name: [p.as_dict() for p in found] for name, found in plans.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
