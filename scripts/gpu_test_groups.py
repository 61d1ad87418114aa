#!/usr/bin/env python3
"""Run groups of GPU tests side by side, each in its own pytest process.

    python3 scripts/gpu_test_groups.py --logs $OUT --timeout 540 \\
        --group v1 0 tests/gpu/test_afd_gpu.py "V1 and ipc" \\
        --group nccl 0,1 tests/gpu/test_afd_gpu.py "1a1f and nccl" \\
        --mps-group v1-mps 0 tests/gpu/test_afd_gpu.py "V1 and ipc"

One engine run takes about a minute on the GPU machine, mostly start-up on
the CPU, and device time there is scarce; the tests' engines fix their KV
cache size (``kv_cache_memory_bytes``), so several can share a GPU without
disturbing each other's memory profiling. Each group gets the GPUs named
(``CUDA_VISIBLE_DEVICES``) and writes ``<logs>/<name>.log``. Prints each
group's outcome as it ends; exits non-zero if any group failed or ran out
of time.

``--mps-group`` runs a group under NVIDIA MPS: the first one starts a
private MPS control daemon (``vllm.afd.platform.mps``, as ``"mps": "start"`` does)
whose clients these groups' processes are; ``--group`` runs without MPS
(unless a daemon in the default pipe directory serves the whole machine).
The daemon stops when this script ends.

``--group-env NAME VAR=VALUE`` adds to one group's environment: groups of
another release's trees run beside 0.26.0's under the same daemon with
``--group-env NAME PYTHONPATH=/tmp/site33 --group-env NAME
AFD_STOCK_VLLM=/tmp/pristine33``.
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
    for flag, what in (
        ("--group", "a pytest process: log name, CUDA_VISIBLE_DEVICES, test file, -k expression"),
        ("--mps-group", "the same, under a private MPS daemon"),
    ):
        parser.add_argument(
            flag, nargs=4, action="append", default=[], metavar=("NAME", "GPUS", "FILE", "KEXPR"),
            help=what,
        )  # fmt: skip
    parser.add_argument(
        "--group-env", nargs=2, action="append", default=[], metavar=("NAME", "VAR=VALUE"),
        help="one more environment variable for the group NAME",
    )  # fmt: skip
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=540, help="seconds for all groups")
    args = parser.parse_args()
    names = {g[0] for g in args.group + args.mps_group}
    extra_env: dict[str, dict[str, str]] = {}
    for name, assignment in args.group_env:
        var, sep, value = assignment.partition("=")
        if name not in names or not sep or not var:
            parser.error(
                f"--group-env {name} {assignment}: name a group given with --group "
                f"or --mps-group ({', '.join(sorted(names))}) and write VAR=VALUE"
            )
        extra_env.setdefault(name, {})[var] = value
    args.logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    no_mps = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
    mps = {}
    if args.mps_group:
        from vllm.afd.platform.mps import ensure_private_daemon

        os.environ.pop("CUDA_MPS_PIPE_DIRECTORY", None)
        mps = {"CUDA_MPS_PIPE_DIRECTORY": ensure_private_daemon()}
    running = {}
    groups = [(g, no_mps) for g in args.group] + [(g, {**no_mps, **mps}) for g in args.mps_group]
    for (name, gpus, file, kexpr), group_env in groups:
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", file, "-k", kexpr, "-v", "-s",
               "-p", "no:cacheprovider"]  # fmt: skip
        env = {**group_env, **extra_env.get(name, {}), "CUDA_VISIBLE_DEVICES": gpus}
        log = (args.logs / f"{name}.log").open("w")
        running[name] = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        under = " under MPS" if group_env is not no_mps else ""
        print(f"started {name} on GPU {gpus}{under}: -k {kexpr!r}", flush=True)
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
