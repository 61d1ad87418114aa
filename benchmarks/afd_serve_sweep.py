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
dual-batch overlap (V1 only: refused where vLLM has none). Plot the results
with benchmarks/plot_serve_pareto.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from decode_timing import shaped_model

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.shapes import QWEN3_30B_A3B
from vllm_afd_dev.harness.generate import free_port, worker_env
from vllm_afd_dev.harness.launch import stop, wait_until_healthy
from vllm_afd_dev.harness.model_runner import (
    NoModelRunnerV1,
    model_runner_v1_env,
    prefer_model_runner_v1,
)

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
GPUS = 2
COMMON = [
    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "1024",
    "--max-num-seqs", "256", "--gpu-memory-utilization", "0.85",
    "--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY", "mode": 0}),
    "--shutdown-timeout", "30",
]  # fmt: skip


def deployments(overlap: bool) -> dict[str, list[str]]:
    afd = ["--afd-config", json.dumps({"connector": "nccl", "spawn_ffn": True,
                                       "port": free_port()})]  # fmt: skip
    found = {"colocated DP2": ["--data-parallel-size", "2"], "AFD 1A1F": afd}
    if overlap:
        found["AFD 1A1F overlap"] = [*afd, "--enable-dbo", "--dbo-decode-token-threshold", "4"]
    return found


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
        for name, extra in deployments(args.overlap).items():
            port = free_port()
            slug = name.lower().replace(" ", "-")
            log = args.result_dir / f"{slug}-server.log"
            cmd = [*VLLM, "serve", model, *COMMON, *extra, "--host", "127.0.0.1",
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
