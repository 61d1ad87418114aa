#!/usr/bin/env python3
"""Decode time per output token on one GPU: colocated vLLM with graphs, AFD
eager and AFD with FULL_DECODE_ONLY graphs (ipc connector, both roles on the
same GPU), at several batch sizes, from one run.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_gpu_decode.py

The model has Qwen3-0.6B's dimensions (28 layers, hidden 1024) with dummy
weights, which are fine for timing. Each configuration runs in its own
process: one engine, then for each batch size a prefill-only generation and
a generation of ``--decode-tokens`` more tokens; the difference divided by
the extra tokens is the decode time per output token. Prints the times and
the ratios, and saves them (JSON).

On one GPU the two roles' processes take turns on the device (about 290 us
per layer round trip, see benchmarks/afd_ipc_roundtrip.py), so AFD cannot
beat colocated vLLM here; what the numbers show is the cost of the split and
how much CUDA graphs still save.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import RESULTS, save_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from generate import DEFAULT_MODEL, afd_engine_args, worker_env  # noqa: E402

# Qwen3-0.6B's shape.
QWEN3_0_6B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
ENGINE = dict(
    dtype="bfloat16",
    attention_backend="FLASH_ATTN",
    load_format="dummy",
    gpu_memory_utilization=0.3,
    max_model_len=1024,
    max_num_seqs=32,
    seed=0,
)
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}
CONFIGS = {
    "colocated graphs": dict(ENGINE, compilation_config=GRAPHS),
    "AFD eager": afd_engine_args(dict(ENGINE, enforce_eager=True), connector="ipc"),
    "AFD graphs": afd_engine_args(dict(ENGINE, compilation_config=GRAPHS), connector="ipc"),
}


def qwen3_0_6b_shaped(out: Path) -> Path:
    """A model directory with Qwen3-0.6B's config and the tiny tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.update(QWEN3_0_6B, dtype="bfloat16", layer_types=["full_attention"] * 28)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((DEFAULT_MODEL / name).read_bytes())
    return out


def _worker(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), **json.loads(args.engine_args))

    def timed(batch: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(16)]}
                   for i in range(batch)]  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(1, 4)  # warm-up
    result = {}
    for batch in args.batches:
        prefill = min(timed(batch, 1) for _ in range(2))
        full = timed(batch, 1 + args.decode_tokens)
        result[batch] = 1000 * (full - prefill) / args.decode_tokens
        print(f"batch {batch}: {result[batch]:.2f} ms per output token", flush=True)
    Path(args.out).write_text(json.dumps(result))


def measure(name: str, model: Path, args: argparse.Namespace) -> dict[int, float]:
    print(f"{name} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--model", str(model),
               "--engine-args", json.dumps(CONFIGS[name]), "--out", str(out),
               "--decode-tokens", str(args.decode_tokens),
               "--batches", *map(str, args.batches)]  # fmt: skip
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
        return {int(k): v for k, v in json.loads(out.read_text()).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--engine-args", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_gpu_decode.json")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model = qwen3_0_6b_shaped(Path(tmp) / "qwen3-0.6b-shape")
        ms = {name: measure(name, model, args) for name in CONFIGS}
    print("\ndecode ms per output token (Qwen3-0.6B shape, dummy weights, one GPU)")
    print("batch  colocated graphs  AFD eager  AFD graphs  AFD graphs/colocated  AFD eager/graphs")
    for b in args.batches:
        c, e, g = ms["colocated graphs"][b], ms["AFD eager"][b], ms["AFD graphs"][b]
        print(f"{b:5d}  {c:16.2f}  {e:9.2f}  {g:10.2f}  {g / c:20.2f}  {e / g:15.2f}")
    save_results(
        args.out,
        device=torch.cuda.get_device_name(),
        model={"architecture": "Qwen3ForCausalLM", **QWEN3_0_6B, "weights": "dummy"},
        engine_args=CONFIGS,
        decode_tokens=args.decode_tokens,
        ms_per_output_token=ms,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
