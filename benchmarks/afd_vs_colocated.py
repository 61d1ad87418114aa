#!/usr/bin/env python3
"""Decode time per output token: AFD (1A1F) against colocated vLLM, one run.

    .venv/bin/python benchmarks/afd_vs_colocated.py [--max-tokens 64]

Both runs use the patched vLLM, greedy decoding of the same prompts, in
fresh processes: colocated without ``afd_config``, AFD with ``spawn_ffn``
(the FFN rank as a separate process, gloo on CPU). Prints both times and
their ratio, and writes them with the settings to ``--out`` (JSON).

On CPU both roles share the machine's cores, so the ratio measures the cost
of the split (two processes taking turns, one round trip per layer), not
AFD's gain, which needs separate devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.harness.generate import DEFAULT_MODEL, ENGINE_ARGS, afd_engine_args, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-args", default="{}", help="JSON, merged over the defaults")
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_vs_colocated.json")
    args = parser.parse_args()
    extra = json.loads(args.engine_args)

    # Timed as vLLM runs by default: the engine core in a process of its own.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    print(f"colocated: {args.model} ...", flush=True)
    colocated = run(args.model, extra, max_tokens=args.max_tokens, env=env)
    print("AFD 1A1F (spawned FFN rank) ...", flush=True)
    afd = run(args.model, afd_engine_args(extra), max_tokens=args.max_tokens, env=env)

    ratio = afd["ms_per_step"] / colocated["ms_per_step"]
    print(f"time per output token: colocated {colocated['ms_per_step']:.2f} ms, "
          f"AFD {afd['ms_per_step']:.2f} ms, AFD/colocated {ratio:.2f}")  # fmt: skip
    print(f"same tokens: {afd['tokens'] == colocated['tokens']}")
    save_results(
        args.out,
        machine={"cpus": os.cpu_count(), "platform": platform.platform()},
        model=args.model.name,
        engine_args={**ENGINE_ARGS, **extra},
        max_tokens=args.max_tokens,
        ms_per_token={"colocated": colocated["ms_per_step"], "afd": afd["ms_per_step"]},
        afd_over_colocated=ratio,
        same_tokens=afd["tokens"] == colocated["tokens"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
