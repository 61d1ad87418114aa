#!/usr/bin/env python3
"""vLLM's own serving benchmark with AFD: `vllm serve` for colocated data
parallel 2 and for AFD 1A1F on the same two GPUs, each swept with
`vllm bench serve` over a range of concurrency, results saved by vLLM.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_serve_sweep.py --result-dir DIR \\
        [--concurrency 8 32 128 256] [--layers 8] [--overlap]

This is the recipe as a script: each deployment is one `vllm serve` command
(printed), each point one `vllm bench serve` command (printed) with the
random dataset, `--ignore-eos` and `--save-result`. The model is the
Qwen3-30B-A3B shape of benchmarks/afd_moe_decode.py (dummy weights). Both
deployments use Model Runner V1 (V2 on vLLM 0.34 on, which removed V1) and
FULL_DECODE_ONLY graphs over the eager kernels; ``--overlap`` adds AFD with
dual-batch overlap (V1 only: refused where vLLM has none). Each engine has
its GPU to itself and sizes its KV cache from its profile, at least for
``--max-num-seqs`` sequences of the input and output lengths: its
``--gpu-memory-utilization`` gives it all of the GPU but a margin
(``vllm_afd_dev.bench.gpu_memory``), and a deployment that cannot fit is
refused before any server starts. Plot the results with
benchmarks/plot_serve_pareto.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.gpu_memory import (
    GpuMemoryError,
    cli_args,
    gpu_total_bytes,
    kv_cache_bytes,
    own_gpus_memory,
)
from vllm_afd_dev.bench.shapes import QWEN3_30B_A3B, shaped_model
from vllm_afd_dev.harness.generate import free_port, worker_env
from vllm_afd_dev.harness.launch import stop, wait_until_healthy
from vllm_afd_dev.harness.model_runner import (
    NoModelRunnerV1,
    model_runner_v1_env,
    prefer_model_runner_v1,
)

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
GPUS = 2
MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 256
COMMON = [
    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY", "mode": 0}),
    "--shutdown-timeout", "30",
]  # fmt: skip
REMEDIES = "fewer --layers, shorter --input-len / --output-len, or GPUs with more memory"


def deployments(overlap: bool) -> dict[str, tuple[list[str], dict]]:
    """name: (its ``vllm serve`` arguments beyond ``COMMON``, the same as
    engine arguments for its memory plan, with its DP size)."""
    afd_config = {"connector": "nccl", "spawn_ffn": True, "port": free_port()}
    afd = ["--afd-config", json.dumps(afd_config)]
    found = {
        "colocated DP2": (["--data-parallel-size", "2"], {"dp_size": 2}),
        "AFD 1A1F": (afd, {"afd_config": afd_config}),
    }
    if overlap:
        found["AFD 1A1F overlap"] = (
            [*afd, "--enable-dbo", "--dbo-decode-token-threshold", "4"],
            {"afd_config": afd_config, "enable_dbo": True},
        )
    return found


def memory_args(name: str, settings: dict, shape: dict, sequence_tokens: int) -> list[str]:
    """The ``vllm serve`` memory arguments of deployment ``name`` (its
    ``settings``, ``deployments``), each process on a GPU of its own; exits,
    naming the numbers, if it cannot fit."""
    engine = {"dtype": "bfloat16", "max_num_seqs": MAX_NUM_SEQS, **settings}
    dp = engine.pop("dp_size", 1)
    kv = kv_cache_bytes(shape, MAX_NUM_SEQS, sequence_tokens, MAX_MODEL_LEN)
    try:
        memory, plans = own_gpus_memory(gpu_total_bytes(), shape, engine, kv, dp, REMEDIES)
    except GpuMemoryError as e:
        raise SystemExit(f"{name}: {e}") from None
    for plan in plans:
        print(f"memory of {name}: {plan.describe()}", flush=True)
    return cli_args(memory)


def run_logged(cmd: list[str], log: Path, env: dict) -> None:
    print("$ " + shlex.join(cmd[2:] if cmd[:3] == VLLM else cmd), flush=True)
    with log.open("w") as sink:
        subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    args.result_dir.mkdir(parents=True, exist_ok=True)
    try:
        runner = model_runner_v1_env("--overlap") if args.overlap else prefer_model_runner_v1()
    except NoModelRunnerV1 as e:
        raise SystemExit(str(e)) from None
    env = {**worker_env(), **runner}
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
        tiny = MODELS / "tiny-qwen3-moe"
        model = str(shaped_model(Path(tmp) / "qwen3-30b-a3b-shape", shape, base=tiny))
        found = deployments(args.overlap)
        tokens = args.input_len + args.output_len
        # Every deployment's memory before any server starts.
        memory = {name: memory_args(name, settings, shape, tokens)
                  for name, (_, settings) in found.items()}  # fmt: skip
        for name, (extra, _) in found.items():
            port = free_port()
            slug = name.lower().replace(" ", "-")
            log = args.result_dir / f"{slug}-server.log"
            cmd = [*VLLM, "serve", model, *COMMON, *memory[name], *extra, "--host", "127.0.0.1",
                   "--port", str(port)]  # fmt: skip
            print(f"\n== {name}\n$ {shlex.join(cmd[3:])}", flush=True)
            with log.open("w") as sink:
                server = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                wait_until_healthy(server, port, log, timeout_s=600)
                for c in args.concurrency:
                    bench = [*VLLM, "bench", "serve", "--backend", "vllm", "--model", model,
                             "--base-url", f"http://127.0.0.1:{port}",
                             "--dataset-name", "random", "--random-input-len", str(args.input_len),
                             "--random-output-len", str(args.output_len), "--ignore-eos",
                             "--num-prompts", str(max(4 * c, 32)), "--max-concurrency", str(c),
                             "--save-result", "--result-dir", str(args.result_dir),
                             "--result-filename", f"{slug}-c{c}.json",
                             "--metadata", f"deployment={name}", f"gpus={GPUS}"]  # fmt: skip
                    run_logged(bench, args.result_dir / f"{slug}-c{c}.log", env)
                    point = json.loads((args.result_dir / f"{slug}-c{c}.json").read_text())
                    print(f"   concurrency {c}: {point['output_throughput'] / GPUS:8.0f} output "
                          f"tok/s per GPU, median TPOT {point['median_tpot_ms']:.2f} ms, "
                          f"{point['completed']} completed", flush=True)  # fmt: skip
            finally:
                code = stop(server)
                print(f"   server exited {code}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
