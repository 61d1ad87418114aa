#!/usr/bin/env python3
"""Decode throughput per GPU of a MoE model: AFD 1A1F against colocated data
parallel 2 on two GPUs, and the memory each role holds, from one run.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_moe_decode.py [--layers 8]

The model has Qwen3-30B-A3B's dimensions (128 experts, top-8, hidden 2048)
with fewer layers and dummy weights, which are fine for timing. AFD puts the
attention engine on GPU 0 and its FFN rank on GPU 1 (nccl connector);
colocated runs vLLM's offline data parallel, one full engine per GPU, each
decoding half the batch. Both use FULL_DECODE_ONLY graphs with torch.compile,
vLLM's default path (``--no-compile``: graphs over the eager kernels). The
batch is the number of sequences decoding at once in the whole deployment;
throughput per GPU is output tokens per second divided by the two GPUs. With
data parallelism vLLM shards each MoE layer's experts over the DP ranks, so
a colocated rank holds half the experts. Also prints, per role, the weights (measured in the
engines), the KV cache vLLM gave itself, and the FFN rank's peak memory: the
attention side holds no expert weight, the FFN side no attention weight and
no KV cache. Saves everything (JSON).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from decode_timing import ROOT, Measurement, measure, shaped_model

from generate import afd_engine_args, ffn_weight_bytes
from results_file import RESULTS, save_results

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_local_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
KV_CACHE_GIB = r"Available KV cache memory: ([\d.]+) GiB"
FFN_PEAK_MIB = r"AFD FFN rank \d+: peak device memory ([\d.]+) MiB"
GiB = 2**30


def engine(max_num_seqs: int, compile: bool) -> dict:
    graphs = {"cudagraph_mode": "FULL_DECODE_ONLY"} | ({} if compile else {"mode": 0})
    return dict(
        dtype="bfloat16",
        load_format="dummy",
        gpu_memory_utilization=0.85,
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        compilation_config=graphs,
        seed=0,
    )


def memory(name: str, run: Measurement, afd: bool) -> dict[str, float]:
    row = {
        "weights GiB": run.weight_bytes[0] / GiB,
        "KV cache GiB": run.log_values(KV_CACHE_GIB)[0],
    }
    if afd:
        row["FFN weights GiB"] = ffn_weight_bytes(run.log) / GiB
        row["FFN peak GiB"] = run.log_values(FFN_PEAK_MIB)[0] / 1024
    print(f"{name:14s} " + "  ".join(f"{k} {v:7.2f}" for k, v in row.items()))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="of Qwen3-30B-A3B's 48")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gate-on-attention", action="store_true")
    parser.add_argument(
        "--no-compile", action="store_true", help="graphs over eager kernels: faster start"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_moe_decode.json")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs: AFD's two roles and colocated DP 2 use one each")
    base = engine(max(args.batches), compile=not args.no_compile)
    afd_args = afd_engine_args(
        base, connector="nccl", compute_gate_on_attention=args.gate_on_attention
    )
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
        tiny = ROOT / ".cache" / "models" / "tiny-qwen3-moe"
        model = shaped_model(Path(tmp) / "qwen3-30b-a3b-shape", shape, base=tiny)
        timing = dict(batches=args.batches, decode_tokens=args.decode_tokens)
        colocated = measure("colocated DP2", model, base, dp_size=2, **timing)
        afd = measure("AFD 1A1F", model, afd_args, **timing)
    print(f"\nQwen3-30B-A3B shape, {args.layers} layers, dummy weights, 2 GPUs")
    columns = ["colocated DP2 ms/step", "AFD ms/step", "colocated tok/s/GPU", "AFD tok/s/GPU"]
    print("  ".join(["batch", *columns, "AFD/colocated"]))
    throughput = {}
    for b in args.batches:
        c, a = colocated.ms_per_step[b], afd.ms_per_step[b]
        per_gpu = {"colocated DP2": 1000 * b / c / 2, "AFD 1A1F": 1000 * b / a / 2}
        throughput[b] = per_gpu
        print(f"{b:5d}  {c:21.2f}  {a:11.2f}  {per_gpu['colocated DP2']:18.0f}  "
              f"{per_gpu['AFD 1A1F']:13.0f}  {c / a:13.2f}")  # fmt: skip
    print("\nmemory per GPU")
    mem = {
        "colocated DP2 (each rank)": memory("colocated", colocated, afd=False),
        "AFD 1A1F": memory("AFD attention", afd, afd=True),
    }
    save_results(
        args.out,
        device=torch.cuda.get_device_name(),
        model={"architecture": "Qwen3MoeForCausalLM", **shape, "weights": "dummy"},
        engine_args={"colocated DP2": base, "AFD 1A1F": afd_args},
        decode_tokens=args.decode_tokens,
        ms_per_step={"colocated DP2": colocated.ms_per_step, "AFD 1A1F": afd.ms_per_step},
        output_tokens_per_s_per_gpu=throughput,
        memory=mem,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
