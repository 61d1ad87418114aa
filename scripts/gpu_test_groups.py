#!/usr/bin/env python3
"""Run groups of GPU tests side by side, each in its own pytest process.

    python3 scripts/gpu_test_groups.py --logs $OUT --timeout 540 \\
        --group v1 0 tests/gpu/test_afd_gpu.py "V1 and ipc" \\
        --group nccl 0,1 tests/gpu/test_afd_gpu.py "1a1f and nccl"

One engine run takes about a minute on the GPU machine, mostly start-up on
the CPU, and device time there is scarce; the tests' engines fix their KV
cache size (``kv_cache_memory_bytes``), so several can share a GPU without
disturbing each other's memory profiling. Each group gets the GPUs named
(``CUDA_VISIBLE_DEVICES``) and writes ``<logs>/<name>.log``. Prints each
group's outcome as it ends; exits non-zero if any group failed or ran out
of time.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--group",
        nargs=4,
        action="append",
        required=True,
        metavar=("NAME", "GPUS", "FILE", "KEXPR"),
        help="a pytest process: log name, CUDA_VISIBLE_DEVICES, test file, -k expression",
    )
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=540, help="seconds for all groups")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    running = {}
    for name, gpus, file, kexpr in args.group:
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", file, "-k", kexpr, "-v", "-s",
               "-p", "no:cacheprovider"]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        log = (args.logs / f"{name}.log").open("w")
        running[name] = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        print(f"started {name} on GPU {gpus}: -k {kexpr!r}", flush=True)
    failed = []
    while running:
        time.sleep(2)
        out_of_time = time.monotonic() - start > args.timeout
        for name, proc in list(running.items()):
            if proc.poll() is None and not out_of_time:
                continue
            if proc.poll() is None:  # with the engines it started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                outcome = "killed: out of time"
            else:
                lines = (args.logs / f"{name}.log").read_text().strip().splitlines()
                outcome = lines[-1] if lines else f"exit {proc.returncode}"
            if proc.returncode != 0:
                failed.append(name)
            print(f"[{time.monotonic() - start:5.0f} s] {name}: {outcome}", flush=True)
            del running[name]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
