"""Decode time per step of vLLM engines in fresh processes, shared by the GPU
decode benchmarks.

``measure`` starts one process per data-parallel rank (one for a plain or
an AFD engine; AFD spawns its FFN ranks itself). Each builds an ``LLM`` and,
for each batch size after a warm-up generation, times a short generation
and one of ``decode_tokens`` more tokens (best of two each); the difference
divided by the extra tokens is the decode time per step. With data parallelism the ranks
decode their share of the batch in lockstep and the slowest rank counts.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from generate import DEFAULT_MODEL, free_port, worker_env  # noqa: E402

# Both timed generations include the prefill and this many tokens, so their
# difference is decode steps alone.
SHORT = 8


@dataclass
class Measurement:
    ms_per_step: dict[int, float]
    """Decode time per step (one output token per sequence) by total batch."""
    weight_bytes: list[int]
    """Weight bytes of each rank's engine model (attention side under AFD)."""
    log: str
    """What the rank processes printed, spawned FFN ranks included."""

    def log_values(self, pattern: str) -> list[float]:
        """Every number the log shows for a one-group ``pattern``."""
        return [float(v.replace(",", "")) for v in re.findall(pattern, self.log)]


def shaped_model(out: Path, config: dict, base: Path = DEFAULT_MODEL) -> Path:
    """A model directory with ``config`` laid over the tiny model ``base``'s
    and its tokenizer; with ``load_format="dummy"`` it needs no weights."""
    out.mkdir(parents=True, exist_ok=True)
    merged = {**json.loads((base / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    return out


class RankBarrier:
    """Lines up the data-parallel ranks' processes before each timed call
    (files in a shared directory): vLLM's DP ranks step in lockstep, so a
    rank that starts early would time its wait for the others."""

    def __init__(self, directory: Path, rank: int, size: int, timeout_s: float = 600) -> None:
        self.directory, self.rank, self.size, self.timeout_s = directory, rank, size, timeout_s
        self.calls = 0

    def wait(self) -> None:
        self.calls += 1
        (self.directory / f"{self.calls}.{self.rank}").touch()
        deadline = time.monotonic() + self.timeout_s
        while not all((self.directory / f"{self.calls}.{r}").exists() for r in range(self.size)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DP rank {self.rank}: the other ranks did not reach call "
                                   f"{self.calls} within {self.timeout_s:.0f} s")  # fmt: skip
            time.sleep(0.005)


def _worker(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), **json.loads(args.engine_args))
    barrier = RankBarrier(args.sync_dir, args.rank, args.dp_size)

    def timed(batch: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(16)]}
                   for i in range(batch)]  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        barrier.wait()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    ms = {}
    for batch in args.batches:
        timed(batch, SHORT)  # warm-up at this batch: lazy compilation, allocations
        short = min(timed(batch, SHORT) for _ in range(2))
        long = min(timed(batch, SHORT + args.decode_tokens) for _ in range(2))
        ms[batch] = 1000 * (long - short) / args.decode_tokens
        print(f"batch {batch}: {ms[batch]:.2f} ms per decode step", flush=True)
    import generate  # by module name, so that the engine process can import it

    placement = llm.apply_model(generate.ffn_placement)[0]
    Path(args.out).write_text(json.dumps({"ms": ms, "weight_bytes": placement["weight_bytes"]}))


def measure(
    name: str,
    model: Path,
    engine_args: dict,
    batches: list[int],
    decode_tokens: int,
    dp_size: int = 1,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
) -> Measurement:
    """Time ``engine_args`` on ``model``; with ``dp_size`` > 1, as vLLM's
    offline data parallel (one process per rank, rank r on GPU r), each rank
    decoding ``batch // dp_size`` sequences, all ranks starting each timed
    generation together. ``env`` is added to the processes' environment."""
    print(f"{name} ...", flush=True)
    master_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = []
        for rank in range(dp_size):
            out, log = Path(tmp) / f"rank{rank}.json", Path(tmp) / f"rank{rank}.log"
            rank_env = {**worker_env(), **(env or {})}
            if dp_size > 1:
                rank_env.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank),
                           VLLM_DP_SIZE=str(dp_size), VLLM_DP_MASTER_IP="127.0.0.1",
                           VLLM_DP_MASTER_PORT=str(master_port))  # fmt: skip
            cmd = [sys.executable, __file__, "--worker", "--model", str(model),
                   "--engine-args", json.dumps(engine_args), "--out", str(out),
                   "--decode-tokens", str(decode_tokens), "--sync-dir", tmp,
                   "--rank", str(rank), "--dp-size", str(dp_size),
                   "--batches", *(str(b // dp_size) for b in batches)]  # fmt: skip
            with log.open("w") as sink:
                proc = subprocess.Popen(cmd, env=rank_env, stdout=sink, stderr=subprocess.STDOUT)
            ranks.append((proc, out, log))
        deadline = time.monotonic() + timeout_s
        for proc, _, _ in ranks:
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log = "".join(f"== rank {r}\n{path.read_text()}" for r, (_, _, path) in enumerate(ranks))
        if any(proc.returncode != 0 or not out.is_file() for proc, out, _ in ranks):
            raise SystemExit(f"{name} failed:\n{log[-8000:]}")
        results = [json.loads(out.read_text()) for _, out, _ in ranks]
    return Measurement(
        ms_per_step={b: max(r["ms"][str(b // dp_size)] for r in results) for b in batches},
        weight_bytes=[r["weight_bytes"] for r in results],
        log=log,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--engine-args", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--decode-tokens", type=int, required=True)
    parser.add_argument("--batches", type=int, nargs="+", required=True)
    parser.add_argument("--sync-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dp-size", type=int, required=True)
    _worker(parser.parse_args())
