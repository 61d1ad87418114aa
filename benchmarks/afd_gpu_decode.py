#!/usr/bin/env python3
"""Decode time per output token on one GPU: colocated vLLM with graphs, AFD
eager and AFD with FULL_DECODE_ONLY graphs (ipc connector, both roles on the
same GPU; its transfers signalling as ``ipc_signal`` "auto" chooses, with
the flag kernels under MPS, and with stream memory operations in every
mode), and AFD with graphs with and without dual-batch overlap (Model
Runner V1), at several batch sizes, without MPS and under MPS, from one
run.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_gpu_decode.py \
        [--shape qwen3-0.6b | qwen3-30b-a3b] [--mps off on] [--configs ...]

The model has Qwen3-0.6B's dimensions (28 layers, hidden 1024) or
Qwen3-30B-A3B's at its full 48 layers (bf16, about 61 GB, of which the FFN
rank holds 58 GB), with dummy weights, which are fine for timing. The
memory settings come from the GPU's memory (``vllm_afd_dev.bench.gpu_memory``):
a fixed KV cache for the largest batch's sequences, and each row's engine
asks for its share of the GPU, the attention engine beside its FFN rank,
colocated alone; a row that cannot fit is refused, with the numbers, before
any runs (the 30B shape fits an 80 GB H100 as well as an H200). Each
configuration runs in its own processes (benchmarks/decode_timing.py),
``--repeats`` timed generations each; the decode time per step is the time
per output token of each sequence. ``--mps on`` runs the configurations as
clients of a private MPS control daemon that this run starts
(``vllm.afd.platform.mps``), ``off`` without one. Prints the mean times with their
spread and the ratios, and saves them (JSON).

Without MPS the two roles' processes take turns on the device (about 290 us
per layer round trip, see benchmarks/afd_ipc_roundtrip.py) and the numbers
show the cost of that time slicing; under an MPS daemon (about 16 us per
layer) they show the cost of the split itself.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from decode_timing import measure, sequence_tokens

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.gpu_memory import (
    GpuMemoryError,
    GpuPlan,
    gpu_total_bytes,
    kv_cache_bytes,
    one_gpu_memory,
)
from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.bench.shapes import QWEN3_0_6B, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, shaped_model
from vllm_afd_dev.harness.generate import afd_engine_args
from vllm_afd_dev.harness.model_runner import NoModelRunnerV1, model_runner_v1_env

SHAPES = {  # name: (config, checkpoint whose tokenizer it takes)
    "qwen3-0.6b": (
        dict(QWEN3_0_6B, dtype="bfloat16", layer_types=["full_attention"] * 28),
        "tiny-qwen3",
    ),
    "qwen3-30b-a3b": (
        dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS),
        "tiny-qwen3-moe",
    ),
}
ENGINE = dict(
    dtype="bfloat16",
    attention_backend="FLASH_ATTN",
    load_format="dummy",
    max_model_len=1024,
    seed=0,
)
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}
# Dual-batch overlap runs on Model Runner V1 only; its threshold is lowered
# so that every batch size here splits into two stages.
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2)
V1, V2 = True, False
"""Whether a row runs on Model Runner V1 (refused where vLLM has none)."""


REMEDIES = (
    "a smaller largest batch (--batches) or fewer --decode-tokens (less KV cache), the "
    "qwen3-0.6b shape, or a GPU with more memory"
)


def configs(shape: str, max_batch: int) -> dict[str, tuple[dict, bool]]:
    """name: (engine arguments, on Model Runner V1), for ``shape`` up to
    ``max_batch``, without memory settings (``with_memory``)."""
    engine = dict(ENGINE, max_num_seqs=max_batch)
    graphs = dict(engine, compilation_config=GRAPHS)
    afd_graphs = afd_engine_args(graphs, connector="ipc")
    return {
        "colocated graphs": (graphs, V2),
        "AFD eager": (afd_engine_args(dict(engine, enforce_eager=True), connector="ipc"), V2),
        # ipc_signal "auto": the flag kernels under MPS, stream operations without.
        "AFD graphs": (afd_graphs, V2),
        "AFD graphs, stream operations": (
            afd_engine_args(graphs, connector="ipc", ipc_signal="stream"),
            V2,
        ),
        "AFD graphs V1": (afd_graphs, V1),
        "AFD graphs V1+DBO": (dict(afd_graphs, **DBO), V1),
        # What failover costs while nothing fails: a host wait after each forward.
        "AFD graphs V1 failover": (
            afd_engine_args(graphs, connector="ipc", failover_timeout_s=300),
            V1,
        ),
    }


def with_memory(
    rows: dict[str, tuple[dict, bool]], config: dict, kv_cache: int, total_bytes: int
) -> tuple[dict[str, tuple[dict, bool]], dict[str, GpuPlan]]:
    """``rows`` with each engine's memory settings on one GPU of
    ``total_bytes`` (an AFD row's attention engine beside its FFN rank, a
    colocated row's engine alone) and a fixed KV cache of ``kv_cache``
    bytes, and each row's plan; ``GpuMemoryError`` for a row that cannot fit."""
    planned, plans = {}, {}
    for name, (engine_args, v1) in rows.items():
        gpu = f"one GPU for the row {name!r}"
        memory, plans[name] = one_gpu_memory(
            total_bytes, config, engine_args, kv_cache, gpu, REMEDIES
        )
        planned[name] = (engine_args | memory, v1)
    return planned, plans


def mps_env(mps: str) -> dict[str, str]:
    """The environment of a configuration's processes for MPS mode ``mps``."""
    if mps == "off":
        return {"CUDA_MPS_PIPE_DIRECTORY": ""}
    from vllm.afd.platform.mps import ensure_private_daemon

    return {"CUDA_MPS_PIPE_DIRECTORY": ensure_private_daemon()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mps", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(configs("qwen3-0.6b", 1)),
        default=["colocated graphs", "AFD graphs"],
        help="rows to run",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch
    from vllm.afd.platform.mps import DEFAULT_PIPE_DIR, daemon_answers

    if "off" in args.mps and daemon_answers(DEFAULT_PIPE_DIR):
        raise SystemExit(
            f"an MPS daemon serves this machine ({DEFAULT_PIPE_DIR}): every process joins it, "
            "so 'off' cannot be measured; stop it (echo quit | nvidia-cuda-mps-control) "
            "or pass --mps on"
        )
    config, tokenizer_model = SHAPES[args.shape]
    chosen = {name: row for name, row in configs(args.shape, max(args.batches)).items()
              if name in args.configs}  # fmt: skip
    kv = kv_cache_bytes(config, max(args.batches), sequence_tokens(args.decode_tokens),
                        ENGINE["max_model_len"])  # fmt: skip
    try:  # every row's memory before any runs
        rows, plans = with_memory(chosen, config, kv, gpu_total_bytes())
    except GpuMemoryError as e:
        raise SystemExit(str(e)) from None
    for name, plan in plans.items():
        print(f"memory of {name!r}: {plan.describe()}", flush=True)
    try:  # vLLM 0.34 on has no V1: refuse its rows before running any
        runner_envs = {
            name: model_runner_v1_env(f"the row {name!r}") if rows[name][1] else {}
            for name in args.configs
        }
    except NoModelRunnerV1 as e:
        raise SystemExit(str(e)) from None
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = MODELS / tokenizer_model
        model = shaped_model(Path(tmp) / f"{args.shape}-shape", config, base=base)
        for mps in args.mps:
            env = mps_env(mps)
            for name in args.configs:
                engine_args = rows[name][0]
                runs[(mps, name)] = measure(
                    f"{name}, MPS {mps}", model, engine_args, args.batches, args.decode_tokens,
                    env=runner_envs[name] | env, repeats=args.repeats,
                )  # fmt: skip
    print(f"\ndecode ms per output token ({args.shape} shape, dummy weights, one GPU), "
          f"mean (spread) of {args.repeats}")  # fmt: skip
    names = [f"{name}, MPS {mps}" for mps, name in runs]
    ratios = [(mps, name) for mps, name in runs
              if name != "colocated graphs" and (mps, "colocated graphs") in runs]  # fmt: skip
    print("batch  " + "  ".join(f"{n:>26s}" for n in names)
          + "".join(f"  {n + ' / colocated, MPS ' + m:>38s}" for m, n in ratios))  # fmt: skip
    for b in args.batches:
        cells = "  ".join(
            f"{run.ms_per_step[b]:17.3f} ({run.spread(b):5.1%})" for run in runs.values()
        )
        quotients = "".join(
            f"  {runs[r].ms_per_step[b] / runs[(r[0], 'colocated graphs')].ms_per_step[b]:38.2f}"
            for r in ratios
        )
        print(f"{b:5d}  {cells}{quotients}")
    save_results(
        args.out or RESULTS / f"afd_gpu_decode_{args.shape}.json",
        device=torch.cuda.get_device_name(),
        model={"shape": args.shape, **config, "weights": "dummy"},
        engine_args={
            name: {"engine": rows[name][0], "env": rows[name][1]} for name in args.configs
        },
        memory={name: plan.as_dict() for name, plan in plans.items()},
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        ms_per_output_token={
            f"{name}, MPS {mps}": run.repeats for (mps, name), run in runs.items()
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
