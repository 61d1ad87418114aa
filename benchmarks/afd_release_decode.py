#!/usr/bin/env python3
"""One-GPU decode on several vLLM releases from one run: AFD / colocated
time per output token on each release, and each release's times against the
first one's.

    python3 benchmarks/afd_release_decode.py \
        --release 0.26.0=/tmp/site --release 0.34.0=/tmp/site34 \
        [--shape qwen3-30b-a3b] [--batches 8 32] [--mps on] [-- afd_gpu_decode options]

Each ``--release NAME=PYTHONPATH`` runs ``benchmarks/afd_gpu_decode.py``
(rows "colocated graphs" and "AFD graphs") under that PYTHONPATH, one release
after the other on the same GPU; the releases' patched trees must hold the
same series. Prints each release's mean times with their spread and the
ratios, and saves them (JSON: each release's record as it finishes, then
the comparison). ``--resume`` reads the releases already saved beside
``--out`` instead of running them again: four rows of the 48-layer shape take
about 800 s on an H100, so the releases may take a call each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_afd_dev.bench.results import RESULTS, save_results

DECODE = Path(__file__).with_name("afd_gpu_decode.py")
ROWS = ("colocated graphs", "AFD graphs")


def release(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=PYTHONPATH, e.g. 0.34.0=/tmp/site34"
        )
    return name, path


def run_release(name: str, pythonpath: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, str(DECODE), "--shape", args.shape, "--mps", args.mps,
               "--batches", *map(str, args.batches), "--decode-tokens", str(args.decode_tokens),
               "--repeats", str(args.repeats), "--configs", *ROWS, "--out", str(out),
               *args.decode_args]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=pythonpath)
    print(f"=== vLLM {name} (PYTHONPATH={pythonpath})", flush=True)
    if subprocess.run(command, env=env).returncode != 0:
        raise SystemExit(f"vLLM {name}: afd_gpu_decode.py failed (its output is above)")
    return json.loads(out.read_text())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / mean(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", type=release, action="append", required=True,
                        metavar="NAME=PYTHONPATH")  # fmt: skip
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mps", choices=["off", "on"], default="on")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="read the releases whose record is saved beside --out instead of running them "
        "(the releases of one GPU split over calls)",
    )
    parser.add_argument("decode_args", nargs="*", help="more afd_gpu_decode.py options")
    args = parser.parse_args()
    out = args.out or RESULTS / f"afd_release_decode_{args.shape}.json"
    # Each release's own record stays beside the comparison, so that a run
    # cut short keeps the releases it finished.
    records = {}
    for name, pythonpath in args.release:
        record = out.with_name(f"{out.stem}.{name}.json")
        if args.resume and record.is_file():
            records[name] = json.loads(record.read_text())
            print(f"=== vLLM {name}: its record {record} ({records[name]['date']}, "
                  f"{records[name]['device']})", flush=True)  # fmt: skip
        else:
            records[name] = run_release(name, pythonpath, args, record)
    devices = {name: rec["device"] for name, rec in records.items()}
    if len(set(devices.values())) > 1:
        raise SystemExit(
            f"the releases ran on different GPUs ({devices}): their times do not compare; "
            "run them again on one GPU (without --resume, or with the other records removed)"
        )
    times = {
        name: {row: rec["ms_per_output_token"][f"{row}, MPS {args.mps}"] for row in ROWS}
        for name, rec in records.items()
    }
    first = args.release[0][0]
    widths = {row: len(f"{row} / {first}") for row in ROWS}
    print(f"\ndecode ms per output token ({args.shape} shape, MPS {args.mps}), "
          f"mean (spread) of {args.repeats}")  # fmt: skip
    header = "batch  release   " + "".join(f"{row:>22s}" for row in ROWS)
    print(header + "  AFD / colocated" + "".join(f"  {row} / {first}" for row in ROWS))
    for b in args.batches:
        for name, rows in times.items():
            cells = "".join(
                f"{mean(rows[r][str(b)]):13.3f} ({spread(rows[r][str(b)]):5.1%})" for r in ROWS
            )
            ratio = mean(rows["AFD graphs"][str(b)]) / mean(rows["colocated graphs"][str(b)])
            against = "".join(
                f"  {mean(rows[r][str(b)]) / mean(times[first][r][str(b)]):>{width}.2f}"
                for r, width in widths.items()
            )
            print(f"{b:5d}  {name:8s}  {cells}  {ratio:15.2f}{against}")
    save_results(
        out,
        shape=args.shape,
        mps=args.mps,
        releases={name: records[name] for name, _ in args.release},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
