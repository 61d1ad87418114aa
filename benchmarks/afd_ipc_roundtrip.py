#!/usr/bin/env python3
"""Round trip per layer of the ipc connector, two processes on one GPU or two.

    PYTHONPATH=<patched vLLM> python3 benchmarks/afd_ipc_roundtrip.py [--ffn-gpu 1] [--mps off on]
        [--signal stream kernel]

An "attention" process and an "FFN" process share the connector's buffer and
flags (``IpcSlots``, the code the connector runs). Each captures one CUDA graph of
``--layers`` layers: the attention side sends a slot of hidden states and
waits for the answer; the FFN side waits, and sends the rows back (no
compute). Both replay in lockstep; the attention side times its replays.
The same bytes copied twice per layer inside one process give the
device-to-device baseline. Without MPS two processes on one GPU take
turns on it (the GPU switches between their contexts, hundreds of us per
layer round trip on an H200); under an MPS daemon their work runs side by
side. ``--mps off on`` (the default)
measures both ways in one run, each in fresh processes: without MPS, and as
clients of a private MPS control daemon that the run starts
(``vllm.afd.platform.mps``); each size is timed ``--repeats`` times, printed as the
median with its range, and the ratio of the medians. With
``--ffn-gpu 1`` the FFN process runs on the second GPU: it maps the
attention process's buffer through peer access, and its stream writes and
waits on the other GPU's memory. ``--signal`` picks how both sides signal
(``IpcSlots``, the connector's ``ipc_signal``): ``stream`` memory
operations on the host page, or ``kernel``, the flag kernels of
``flag_kernels``, a copy that raises the flag and a one-block spin (MPS
only); each pair of MPS mode and signal is a column of its own, with the
first column's time over each other's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vllm_afd_dev.bench.graph_timing import WARMUP_REPLAYS, capture_layers, us_per_layer
from vllm_afd_dev.bench.results import RESULTS, save_results


def _layout(args):
    from vllm.distributed.afd_transfer.afd_connector.ipc_slots import IpcBufferLayout

    width = args.hidden_size
    return IpcBufferLayout(max(args.tokens), (width, width), torch.bfloat16)


def ffn_process(args, conn) -> None:
    from vllm.distributed.afd_transfer.afd_connector.ipc_slots import (
        TO_ATTENTION,
        TO_FFN,
        IpcSlots,
        import_cuda_tensor,
    )
    from vllm.distributed.afd_transfer.stream_flags import SharedFlags

    torch.cuda.set_device(args.ffn_gpu)
    layout = _layout(args)
    shared = conn.recv()
    buffer = import_cuda_tensor(shared["buffer"], args.ffn_gpu)
    flags = SharedFlags(layout.num_flags, shared["flags"])
    slots = IpcSlots(layout, buffer, flags, args.measure_signal)
    conn.send("mapped")
    while (msg := conn.recv()) is not None:
        n, replays = msg
        graph = capture_layers(
            args.layers,
            lambda n=n: slots.send(TO_ATTENTION, 0, slots.receive(TO_FFN, 0, n)),
        )
        conn.send("captured")
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        conn.send("done")
    flags.close()


def measure(args) -> list[dict]:
    """This process as the attention side, a spawned one as the FFN side:
    each size's round trip ``args.repeats`` times, and the same copies in
    one process."""
    from vllm.distributed.afd_transfer.afd_connector.ipc_slots import (
        TO_ATTENTION,
        TO_FFN,
        IpcSlots,
        export_cuda_tensor,
    )
    from vllm.distributed.afd_transfer.stream_flags import SharedFlags

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=ffn_process, args=(args, child_conn), daemon=True)
    child.start()
    torch.cuda.set_device(0)
    layout = _layout(args)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda")
    flags = SharedFlags(layout.num_flags)
    slots = IpcSlots(layout, buffer, flags, args.measure_signal)
    conn.send({"buffer": export_cuda_tensor(buffer), "flags": flags.name})
    assert conn.recv() == "mapped"
    rows = []
    for n in args.tokens:
        x = torch.randn(n, args.hidden_size, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)

        def layer(n=n, x=x, out=out):
            slots.send(TO_FFN, 0, x)
            out.copy_(slots.receive(TO_ATTENTION, 0, n))

        # The FFN side replays in lockstep: every repeat's warm-ups and replays.
        conn.send((n, args.repeats * (WARMUP_REPLAYS + args.replays)))
        graph = capture_layers(args.layers, layer)
        assert conn.recv() == "captured"
        ipc_us = [us_per_layer(graph, args.replays, args.layers) for _ in range(args.repeats)]
        assert conn.recv() == "done"
        assert torch.equal(out, x), "the round trip changed the rows"

        staging = torch.empty_like(x)
        copies = capture_layers(args.layers, lambda x=x, s=staging, o=out: (s.copy_(x), o.copy_(s)))
        copy_us = us_per_layer(copies, args.replays, args.layers)
        print(f"  {args.measure_signal}, {n} tokens: {spread(ipc_us)} per layer", flush=True)
        rows.append(
            {
                "tokens": n,
                "bytes": n * args.hidden_size * 2,
                "ipc_us_per_layer": statistics.median(ipc_us),
                "ipc_us_per_layer_repeats": ipc_us,
                "d2d_copy_us_per_layer": copy_us,
            }
        )
    conn.send(None)
    child.join(timeout=30)
    flags.close()
    return rows


def run_under(mps: str, signal: str, args) -> list[dict]:
    """``measure`` in a fresh process, with MPS ("on": a client of the
    private daemon this process started) or without ("off"), signalling
    with ``signal``."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
    if mps == "on":
        from vllm.afd.platform.mps import ensure_private_daemon

        env["CUDA_MPS_PIPE_DIRECTORY"] = ensure_private_daemon()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--measure-into", str(rows_file),
               "--measure-signal", signal]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        return json.loads(rows_file.read_text())


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} us ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3, help="timings per size and MPS mode")
    parser.add_argument(
        "--ffn-gpu", type=int, default=0, help="the FFN process's GPU (attention: GPU 0)"
    )
    parser.add_argument(
        "--mps", nargs="+", choices=["off", "on"], default=["off", "on"], help="MPS modes to run"
    )
    parser.add_argument(
        "--signal",
        nargs="+",
        choices=["stream", "kernel"],
        default=["stream", "kernel"],
        help="ways of signalling to run",
    )
    parser.add_argument("--measure-into", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure-signal", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.measure_into:  # a child of run_under
        args.measure_into.write_text(json.dumps(measure(args)))
        return 0
    from vllm.afd.platform.mps import DEFAULT_PIPE_DIR, daemon_answers

    if "off" in args.mps and daemon_answers(DEFAULT_PIPE_DIR):
        raise SystemExit(
            f"an MPS daemon serves this machine ({DEFAULT_PIPE_DIR}): every process joins it, "
            "so 'off' cannot be measured; stop it (echo quit | nvidia-cuda-mps-control) "
            "or pass --mps on"
        )
    one_gpu = args.ffn_gpu == 0
    name = "afd_ipc_roundtrip" if one_gpu else f"afd_ipc_roundtrip_gpu0_gpu{args.ffn_gpu}"
    out_file = args.out or RESULTS / f"{name}.json"
    by_mode = {
        f"MPS {mps}, {signal}": run_under(mps, signal, args)
        for mps in args.mps
        for signal in args.signal
    }
    first_mode = next(iter(by_mode))
    print(f"\nipc round trip per layer ({args.layers} layers, median of {args.repeats} "
          f"timings of {args.replays} replays, range; ratios: {first_mode} over each)")  # fmt: skip
    header = "tokens  bytes     " + "".join(f"  {m:>25s}" for m in by_mode)
    ratio_header = "".join(f"  {m:>17s}" for m in list(by_mode)[1:])
    print(header + "  same copies, one process" + ratio_header)
    for i, n in enumerate(args.tokens):
        rows = [by_mode[mode][i] for mode in by_mode]
        line = f"{n:6d}  {rows[0]['bytes'] / 1024:7.1f} KiB"
        line += "".join(f"  {spread(r['ipc_us_per_layer_repeats']):>25s}" for r in rows)
        line += f"  {rows[0]['d2d_copy_us_per_layer']:21.1f} us"
        line += "".join(
            f"  {rows[0]['ipc_us_per_layer'] / r['ipc_us_per_layer']:16.2f}x" for r in rows[1:]
        )
        print(line, flush=True)
    save_results(
        out_file,
        device=torch.cuda.get_device_name(),
        attention_gpu=0,
        ffn_gpu=args.ffn_gpu,
        layers=args.layers,
        hidden_size=args.hidden_size,
        replays=args.replays,
        repeats=args.repeats,
        rows_by_mode=by_mode,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
