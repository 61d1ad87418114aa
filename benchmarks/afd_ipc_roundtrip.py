#!/usr/bin/env python3
"""Round trip per layer of the ipc connector, two processes on one GPU or two.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_ipc_roundtrip.py [--ffn-gpu 1]

An "attention" process and an "FFN" process share the connector's buffer
(``IpcSlots``, the code the connector runs). Each captures one CUDA graph of
``--layers`` layers: the attention side sends a slot of hidden states and
waits for the answer; the FFN side waits, and sends the rows back (no
compute). Both replay in lockstep; the attention side times its replays.
The same bytes copied twice per layer inside one process give the
device-to-device baseline. Printed against the time-sliced figure that
DESIGN.md records for two processes on one H200 without MPS (about 290 us
per layer round trip: the GPU switching between the two contexts; under an
MPS daemon the same exchange takes 13-14 us, so run it both ways). With
``--ffn-gpu 1`` the FFN process runs on the second GPU: the attention
process maps its buffer through peer access, and its stream writes and
waits on the other GPU's memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from pathlib import Path

import torch

from graph_timing import WARMUP_REPLAYS, capture_layers, us_per_layer
from results_file import RESULTS, save_results

TIME_SLICED_US = 290.0  # DESIGN.md: two processes, one H200, no MPS, 2 KB .. 512 KB


def _layout(args):
    from vllm.distributed.afd_transfer.afd_connector.ipc_connector import IpcBufferLayout

    width = args.hidden_size
    return IpcBufferLayout(1, max(args.tokens), (width, width), torch.bfloat16)


def ffn_process(args, conn) -> None:
    from vllm.distributed.afd_transfer.afd_connector.ipc_connector import (
        TO_ATTENTION,
        TO_FFN,
        IpcSlots,
        export_cuda_tensor,
    )

    torch.cuda.set_device(args.ffn_gpu)
    layout = _layout(args)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slots = IpcSlots(layout, buffer)
    conn.send(export_cuda_tensor(buffer))
    while (msg := conn.recv()) is not None:
        n, replays = msg
        graph = capture_layers(
            args.layers,
            lambda n=n: slots.send(TO_ATTENTION, 0, 0, slots.receive(TO_FFN, 0, 0, n)),
        )
        conn.send("captured")
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        conn.send("done")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--ffn-gpu", type=int, default=0, help="the FFN process's GPU (attention: GPU 0)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    one_gpu = args.ffn_gpu == 0
    name = "afd_ipc_roundtrip" if one_gpu else f"afd_ipc_roundtrip_gpu0_gpu{args.ffn_gpu}"
    out_file = args.out or RESULTS / f"{name}.json"
    from vllm.distributed.afd_transfer.afd_connector.ipc_connector import (
        TO_ATTENTION,
        TO_FFN,
        IpcSlots,
        import_cuda_tensor,
    )

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=ffn_process, args=(args, child_conn), daemon=True)
    child.start()
    torch.cuda.set_device(0)
    slots = IpcSlots(_layout(args), import_cuda_tensor(conn.recv(), 0))
    rows = []
    for n in args.tokens:
        x = torch.randn(n, args.hidden_size, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)

        def layer(n=n, x=x, out=out):
            slots.send(TO_FFN, 0, 0, x)
            out.copy_(slots.receive(TO_ATTENTION, 0, 0, n))

        total = WARMUP_REPLAYS + args.replays
        conn.send((n, total))
        graph = capture_layers(args.layers, layer)
        assert conn.recv() == "captured"
        ipc_us = us_per_layer(graph, args.replays, args.layers)
        assert conn.recv() == "done"
        assert torch.equal(out, x), "the round trip changed the rows"

        staging = torch.empty_like(x)
        copies = capture_layers(args.layers, lambda x=x, s=staging, o=out: (s.copy_(x), o.copy_(s)))
        copy_us = us_per_layer(copies, args.replays, args.layers)
        row = {
            "tokens": n,
            "bytes": n * args.hidden_size * 2,
            "ipc_us_per_layer": ipc_us,
            "d2d_copy_us_per_layer": copy_us,
        }
        line = (f"{n:4d} tokens ({row['bytes'] / 1024:7.1f} KiB): ipc round trip "
                f"{row['ipc_us_per_layer']:7.1f} us/layer, same copies in one process "
                f"{row['d2d_copy_us_per_layer']:5.1f} us/layer")  # fmt: skip
        if one_gpu:  # two contexts on one GPU
            row["ipc_over_time_sliced"] = row["ipc_us_per_layer"] / TIME_SLICED_US
            line += (
                f", ipc / time-sliced ({TIME_SLICED_US:.0f} us) {row['ipc_over_time_sliced']:.2f}"
            )
        rows.append(row)
        print(line, flush=True)
    conn.send(None)
    child.join(timeout=30)
    save_results(
        out_file,
        device=torch.cuda.get_device_name(),
        attention_gpu=0,
        ffn_gpu=args.ffn_gpu,
        layers=args.layers,
        hidden_size=args.hidden_size,
        time_sliced_us_per_layer=TIME_SLICED_US if one_gpu else None,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
