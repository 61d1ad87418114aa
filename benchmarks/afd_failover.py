#!/usr/bin/env python3
"""Failover on CPU: from an FFN rank's kill to the next token, per kind of
replacement, and the cost of failover when nothing fails. One run.

    .venv/bin/python benchmarks/afd_failover.py [--repeats 3]

`vllm serve` (1A1F, gloo, the built-in tiny model) streams greedy
completions while its FFN rank is killed (SIGKILL), ``--repeats`` times per
kind of replacement:

* ``respawn``: `spawn_ffn` starts a new FFN process;
* ``hand-started``: a `vllm afd-ffn` started right after the kill;
* ``standby``: a `vllm afd-ffn` with ``standby``, weights loaded before
  the kill;
* ``new-address``: a `vllm afd-ffn` started right after the kill at
  another address, one of the attention rank's ``failover_hosts``
  (127.0.0.1 and 127.0.0.2 in turn);
* ``respawn-in-place``: a respawn for the built-in tiny Qwen3-Next, whose
  recurrent state makes gloo resume the forward in place instead of
  running it again.

Then a lost attention rank: two `vllm serve` deployments (``attention_rank``
0 and 1) share an FFN rank with ``failover_timeout_s``; rank 0's engine is
killed while both stream, and the figure is rank 1's longest pause around
the kill (the FFN rank drops rank 0 and serves rank 1 on), beside its
median step time.

The figure is the time from the kill to the first token made after it,
seen by the client (``StreamingCompletions.next_token_after``), beside the
attention rank's own count from losing the FFN rank to a connected
replacement. Then, with nothing killed, the decode time per token of the
same requests with ``failover_timeout_s`` 0 and above 0, alternating,
``--repeats`` times each. Prints medians and ranges, saves everything to
``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from vllm_afd_dev import MODELS
from vllm_afd_dev.bench.results import RESULTS, save_results
from vllm_afd_dev.harness.generate import (
    DEFAULT_MODEL,
    PROMPTS,
    failure_report,
    free_port,
    spawned_ffn_processes,
)
from vllm_afd_dev.harness.launch import (
    StreamingCompletions,
    ffn_server,
    kill_engine,
    serve,
    stop,
    wait_until_healthy,
)
from vllm_afd_dev.models.tiny_model import ensure_model

ENGINE = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
          "--shutdown-timeout", "30")  # fmt: skip
HYBRID_ENGINE = ("--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32",
                 *ENGINE[2:])  # fmt: skip
"""Qwen3-Next on vLLM's CPU backend (its GDN kernels need bfloat16)."""
TOOK_OVER = re.compile(r"an FFN rank took the lost one's place after ([\d.]+) s")


@contextmanager
def server(
    model: Path,
    tmp: Path,
    name: str,
    afd_port: int | None = None,
    engine: tuple[str, ...] = ENGINE,
    **afd: object,
):
    """`vllm serve` with AFD (on ``afd_port``, whose FFN rank is already
    started, or a free one); yields (its HTTP port, its log, its AFD port,
    its process)."""
    port, log = free_port(), tmp / f"{name}.log"
    afd_port = afd_port or free_port()
    config = json.dumps({"port": afd_port, "timeout_s": 60, **afd})
    proc = serve(model, port, log, *engine, "--afd-config", config)
    try:
        wait_until_healthy(proc, port, log)
        yield port, log, afd_port, proc
    finally:
        stop(proc)


def load(port: int, model: Path, requests: int, tokens: int) -> StreamingCompletions:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    return StreamingCompletions(port, model, prompts, tokens)


def wait_in_log(log: Path, text: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log} never said {text!r}")
        time.sleep(0.2)


def failovers(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}

    def measure(
        kind: str, port: int, log: Path, kill, replace=lambda: None, model: Path = args.model
    ) -> None:
        times = results.setdefault(kind, {"kill_to_next_token_s": [], "reconnect_s": []})
        streams = load(port, model, 4, 200)
        streams.wait_for(40, lambda: failure_report(log.read_text()))
        killed_at = time.monotonic()
        kill()
        replace()
        streams.join()
        assert not streams.errors, streams.errors
        times["kill_to_next_token_s"].append(streams.next_token_after(killed_at))
        times["reconnect_s"].append(float(TOOK_OVER.findall(log.read_text())[-1]))
        next_token, reconnect = times["kill_to_next_token_s"][-1], times["reconnect_s"][-1]
        print(f"{kind}: next token {next_token:.2f} s after the kill "
              f"(reconnected {reconnect:.2f} s after the loss)", flush=True)  # fmt: skip

    with server(args.model, tmp, "respawn", spawn_ffn=True, failover_timeout_s=300) as (
        port, log, afd_port, _,
    ):  # fmt: skip
        for _ in range(args.repeats):
            [ffn] = spawned_ffn_processes(afd_port)
            measure("respawn", port, log, lambda ffn=ffn: ffn.send_signal(signal.SIGKILL))

    hybrid = ensure_model("qwen3_next", MODELS / "tiny-qwen3-next")
    with server(hybrid, tmp, "in-place", engine=HYBRID_ENGINE, spawn_ffn=True,
                failover_timeout_s=300) as (port, log, afd_port, _):  # fmt: skip
        for _ in range(args.repeats):
            [ffn] = spawned_ffn_processes(afd_port)
            measure("respawn-in-place", port, log,
                    lambda ffn=ffn: ffn.send_signal(signal.SIGKILL), model=hybrid)  # fmt: skip

    ffn_logs = iter(tmp / f"ffn{i}.log" for i in range(100))
    afd_port = free_port()
    ranks = [ffn_server(args.model, afd_port, next(ffn_logs))]
    with server(args.model, tmp, "hand", afd_port, failover_timeout_s=300) as (port, log, *_):
        try:
            for _ in range(args.repeats):
                measure(
                    "hand-started", port, log, ranks[-1].kill,
                    lambda: ranks.append(ffn_server(args.model, afd_port, next(ffn_logs))),
                )  # fmt: skip
            for _ in range(args.repeats):
                standby_log = next(ffn_logs)
                ranks.append(ffn_server(args.model, afd_port, standby_log, standby=True))
                wait_in_log(standby_log, "waiting to take the place of the FFN rank")
                measure("standby", port, log, ranks[-2].kill)
        finally:
            for rank in ranks:
                rank.kill()

    afd_port, hosts = free_port(), itertools.cycle(["127.0.0.2", "127.0.0.1"])
    ranks = [ffn_server(args.model, afd_port, next(ffn_logs))]
    with server(args.model, tmp, "moved", afd_port, failover_timeout_s=300,
                failover_hosts=["127.0.0.2"]) as (port, log, *_):  # fmt: skip
        try:
            for _ in range(args.repeats):
                measure(
                    "new-address", port, log, ranks[-1].kill,
                    lambda: ranks.append(
                        ffn_server(args.model, afd_port, next(ffn_logs), host=next(hosts))
                    ),
                )  # fmt: skip
        finally:
            for rank in ranks:
                rank.kill()
    return results


def attention_loss(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    """Rank 1's longest pause around the kill of rank 0's engine, and its
    median step time, per repeat (rank 0's deployment restarted each time:
    it joins at its place)."""
    measured: dict[str, list[float]] = {"pause_s": [], "step_s": []}
    topology = {"num_attention_ranks": 2}
    afd_port = free_port()
    ffn = ffn_server(args.model, afd_port, tmp / "ffn-shared.log", failover_timeout_s=300,
                     **topology)  # fmt: skip

    def start(rank: int, name: str) -> tuple[int, Path, subprocess.Popen]:
        port, log = free_port(), tmp / f"{name}.log"
        config = json.dumps({"port": afd_port, "attention_rank": rank, **topology})
        return port, log, serve(args.model, port, log, *ENGINE, "--afd-config", config)

    # The FFN rank admits its first peers together.
    ranks = [start(0, "rank0-0"), start(1, "rank1")]
    try:
        for repeat in range(args.repeats):
            if repeat:
                ranks[0] = start(0, f"rank0-{repeat}")
            for port, log, proc in ranks:
                wait_until_healthy(proc, port, log)
            (port0, log0, proc0), (port1, log1, _) = ranks
            lost, survivor = load(port0, args.model, 4, 200), load(port1, args.model, 4, 200)
            for streams, log in ((lost, log0), (survivor, log1)):
                streams.wait_for(40, lambda log=log: failure_report(log.read_text()))
            killed_at = time.monotonic()
            kill_engine(proc0)
            survivor.join()
            lost.join(timeout_s=120)
            stop(proc0)
            assert lost.errors and not survivor.errors, (lost.errors, survivor.errors)
            step = statistics.median(b - a for a, b in itertools.pairwise(survivor.arrivals[::4]))
            measured["pause_s"].append(survivor.next_token_after(killed_at))
            measured["step_s"].append(step)
            print(f"attention rank lost: rank 1's next token {measured['pause_s'][-1]:.2f} s "
                  f"after the kill (its step: {1000 * step:.1f} ms)", flush=True)  # fmt: skip
    finally:
        for _, _, proc in ranks:
            stop(proc)
        ffn.kill()
    return measured


def decode_cost(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    """Decode time per step of 8 streaming requests, spawn_ffn, failover off
    and on: both servers up, measured in turn (the idle one waits)."""
    per_token: dict[str, list[float]] = {"failover_off": [], "failover_on": []}
    with ExitStack() as servers:
        ports = {
            name: servers.enter_context(
                server(args.model, tmp, name, spawn_ffn=True, failover_timeout_s=timeout)
            )[0]
            for name, timeout in (("failover_off", 0), ("failover_on", 300))
        }
        for port in ports.values():
            load(port, args.model, 8, 8).join()  # warm-up
        for _ in range(args.repeats):
            for name, port in ports.items():
                streams = load(port, args.model, 8, args.decode_tokens)
                streams.join()
                # One chunk per request and token: a decode step brings 8.
                steps = streams.arrivals[8 * 8 :: 8]
                gaps = [b - a for a, b in itertools.pairwise(steps)]
                per_token[name].append(1000 * statistics.median(gaps))
                print(f"{name}: {per_token[name][-1]:.2f} ms per decode step (8 requests)",
                      flush=True)  # fmt: skip
    return per_token


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "afd_failover_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        times = failovers(args, Path(tmp))
        lost_peer = attention_loss(args, Path(tmp))
        cost = decode_cost(args, Path(tmp))
    print("\nfrom the kill to the next token (median, range over repeats):")
    for kind, measured in times.items():
        s = summary(measured["kill_to_next_token_s"])
        print(f"  {kind:>16}: {s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})")
    pause, step = summary(lost_peer["pause_s"]), summary(lost_peer["step_s"])
    print(
        f"an attention rank lost: the other's next token {pause['median']:.2f} s after the "
        f"kill ({pause['min']:.2f}-{pause['max']:.2f}); its step {1000 * step['median']:.1f} ms"
    )
    off, on = summary(cost["failover_off"]), summary(cost["failover_on"])
    ratio = on["median"] / off["median"]
    print(f"decode step, 8 requests: failover off {off['median']:.2f} ms "
          f"({off['min']:.2f}-{off['max']:.2f}), on {on['median']:.2f} ms "
          f"({on['min']:.2f}-{on['max']:.2f}), on/off {ratio:.3f}")  # fmt: skip
    save_results(
        args.out,
        machine={"cpus": os.cpu_count(), "platform": platform.platform()},
        model=args.model.name,
        repeats=args.repeats,
        failover={
            k: {m: {"values": v, **summary(v)} for m, v in d.items()} for k, d in times.items()
        },  # fmt: skip
        attention_rank_lost={k: {"values": v, **summary(v)} for k, v in lost_peer.items()},
        decode_ms_per_step={k: {"values": v, **summary(v)} for k, v in cost.items()},
        decode_on_over_off=ratio,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
