#!/usr/bin/env python3
"""Decode time per output token on one GPU: colocated vLLM with graphs, AFD
eager and AFD with FULL_DECODE_ONLY graphs (ipc connector, both roles on the
same GPU), and AFD with graphs with and without dual-batch overlap (Model
Runner V1), at several batch sizes, from one run.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_gpu_decode.py

The model has Qwen3-0.6B's dimensions (28 layers, hidden 1024) with dummy
weights, which are fine for timing. Each configuration runs in its own
process (benchmarks/decode_timing.py); the decode time per step is the time
per output token of each sequence. Prints the times and the ratios, and
saves them (JSON).

Without MPS the two roles' processes take turns on the device (about 290 us
per layer round trip, see benchmarks/afd_ipc_roundtrip.py) and the numbers
show the cost of that time slicing; under an MPS daemon (13-14 us per
layer) they show the cost of the split itself.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from decode_timing import measure, shaped_model

from generate import afd_engine_args
from results_file import RESULTS, save_results

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
AFD_GRAPHS = afd_engine_args(dict(ENGINE, compilation_config=GRAPHS), connector="ipc")
# Dual-batch overlap runs on Model Runner V1 only; its threshold is lowered
# so that every batch size here splits into two stages.
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2)
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
CONFIGS = {  # name: (engine arguments, environment)
    "colocated graphs": (dict(ENGINE, compilation_config=GRAPHS), {}),
    "AFD eager": (afd_engine_args(dict(ENGINE, enforce_eager=True), connector="ipc"), {}),
    "AFD graphs": (AFD_GRAPHS, {}),
    "AFD graphs V1": (AFD_GRAPHS, V1),
    "AFD graphs V1+DBO": (dict(AFD_GRAPHS, **DBO), V1),
}


# Ratios printed when both of their configurations ran: (name, over, under).
RATIOS = [
    ("AFD graphs / colocated", "AFD graphs", "colocated graphs"),
    ("AFD eager / AFD graphs", "AFD eager", "AFD graphs"),
    ("V1 DBO off / on", "AFD graphs V1", "AFD graphs V1+DBO"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="rows to run"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_gpu_decode.json")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        config = dict(QWEN3_0_6B, dtype="bfloat16", layer_types=["full_attention"] * 28)
        model = shaped_model(Path(tmp) / "qwen3-0.6b-shape", config)
        ms = {
            name: measure(
                name, model, CONFIGS[name][0], args.batches, args.decode_tokens,
                env=CONFIGS[name][1],
            ).ms_per_step
            for name in args.configs
        }  # fmt: skip
    ratios = [r for r in RATIOS if r[1] in ms and r[2] in ms]
    print("\ndecode ms per output token (Qwen3-0.6B shape, dummy weights, one GPU)")
    print("batch  " + "  ".join(f"{name:>17s}" for name in ms) + "".join(
        f"  {r[0]:>22s}" for r in ratios))  # fmt: skip
    for b in args.batches:
        times = "  ".join(f"{ms[name][b]:17.2f}" for name in ms)
        quotients = "".join(f"  {ms[over][b] / ms[under][b]:22.2f}" for _, over, under in ratios)
        print(f"{b:5d}  {times}{quotients}")
    save_results(
        args.out,
        device=torch.cuda.get_device_name(),
        model={"architecture": "Qwen3ForCausalLM", **QWEN3_0_6B, "weights": "dummy"},
        engine_args={name: {"engine": CONFIGS[name][0], "env": CONFIGS[name][1]} for name in ms},
        decode_tokens=args.decode_tokens,
        ms_per_output_token=ms,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
