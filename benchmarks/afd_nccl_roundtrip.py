#!/usr/bin/env python3
"""Round trip per layer of the nccl connector's transport, two GPUs.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_nccl_roundtrip.py

An "attention" process on GPU 0 and an "FFN" process on GPU 1 form a
two-rank group as the nccl connector does (``StatelessProcessGroup`` on a
store bound to 127.0.0.1, vLLM's ``PyNcclCommunicator``). Each captures one
CUDA graph of ``--layers`` layers: the attention side sends a block of
hidden states and receives it back; the FFN side receives and returns it.
Both replay in lockstep; the attention side times its replays. Against it,
measured on the same machine: the same bytes copied GPU 0 -> GPU 1 -> GPU 0
(eager: a capture cannot hold a copy that torch orders against the other
GPU's stream; the launch costs a few us), and the copy bandwidth of a large
block between the two GPUs (NVLink where present). Needs two GPUs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path

import torch

from vllm_afd_dev.bench.graph_timing import WARMUP_REPLAYS, capture_layers, us_per_layer
from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.harness.generate import free_port


def _communicator(rank: int, port: int):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2)
    return PyNcclCommunicator(group, device=torch.cuda.current_device())


def ffn_process(args, port: int, conn) -> None:
    torch.cuda.set_device(1)
    comm = _communicator(1, port)
    while (msg := conn.recv()) is not None:
        n, replays = msg
        rows = torch.empty(n, args.hidden_size, dtype=torch.bfloat16, device="cuda")

        def layer(rows=rows):
            comm.recv(rows, 0)
            comm.send(rows, 0)

        layer()  # eager first: NCCL sets up its peer connection outside the capture
        graph = capture_layers(args.layers, layer)
        conn.send("captured")
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        conn.send("done")


def eager_seconds(fn, repeats: int) -> float:
    """Seconds per call of ``fn``, synchronised, after one untimed call.
    Cross-GPU copies run eager: torch orders them against the peer GPU's
    stream, which a capture on this GPU cannot include."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def copy_bandwidth_gbps(num_bytes: int = 256 << 20, repeats: int = 10) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    return num_bytes / eager_seconds(lambda: dst.copy_(src), repeats) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_nccl_roundtrip.json")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("this benchmark needs two GPUs (NCCL runs one rank per GPU)")
    port = free_port()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=ffn_process, args=(args, port, child_conn), daemon=True)
    child.start()
    torch.cuda.set_device(0)
    comm = _communicator(0, port)
    bandwidth = copy_bandwidth_gbps()
    print(f"GPU 0 -> GPU 1 copy bandwidth: {bandwidth:.1f} GB/s", flush=True)
    rows = []
    for n in args.tokens:
        x = torch.randn(n, args.hidden_size, dtype=torch.bfloat16, device="cuda:0")
        out = torch.empty_like(x)

        def layer(x=x, out=out):
            comm.send(x, 1)
            comm.recv(out, 1)

        conn.send((n, WARMUP_REPLAYS + args.replays))
        layer()
        graph = capture_layers(args.layers, layer)
        assert conn.recv() == "captured"
        nccl_us = us_per_layer(graph, args.replays, args.layers)
        assert conn.recv() == "done"
        assert torch.equal(out, x), "the round trip changed the rows"

        remote = torch.empty_like(x, device="cuda:1")
        copy_us = 1e6 * eager_seconds(
            lambda x=x, r=remote, o=out: (r.copy_(x), o.copy_(r)), args.replays
        )
        num_bytes = x.numel() * x.element_size()
        row = {
            "tokens": n,
            "bytes": num_bytes,
            "nccl_us_per_layer": nccl_us,
            "p2p_copy_us_per_layer": copy_us,
            "bandwidth_bound_us_per_layer": 1e6 * 2 * num_bytes / (bandwidth * 1e9),
        }
        rows.append(row)
        print(f"{n:5d} tokens ({num_bytes / 1024:8.1f} KiB): nccl round trip "
              f"{row['nccl_us_per_layer']:7.1f} us/layer, same bytes copied both ways "
              f"{row['p2p_copy_us_per_layer']:6.1f} us/layer, at full bandwidth "
              f"{row['bandwidth_bound_us_per_layer']:6.1f} us", flush=True)  # fmt: skip
    conn.send(None)
    child.join(timeout=30)
    save_results(
        args.out,
        device=torch.cuda.get_device_name(),
        layers=args.layers,
        hidden_size=args.hidden_size,
        copy_bandwidth_gbps=bandwidth,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
