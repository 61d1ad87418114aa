"""Decode time per step of vLLM engines in fresh processes, shared by the GPU
decode benchmarks.

``measure`` starts one process per data-parallel rank (one for a plain or
an AFD engine; AFD spawns its FFN ranks itself). Each builds an ``LLM`` and,
for each batch size, after a warm-up generation, runs ``repeats`` timed
generations. A generation's decode time per step is read from vLLM's own
per-token timestamps (engine-core clock, streamed per step): the steps in
which every sequence of the batch got a token are the full-batch decode
steps, and once ``decode_tokens`` of them have run the generation is
aborted; the median gap between consecutive ones is the figure. The engine
starts stepping while the prompts still arrive (seen: first tokens spread
over more than a second with data parallelism, the early sequences decoding
in eager mixed steps meanwhile), so wall-clock differences of whole
generations are no measure. A batch that never decodes together long enough
is an error, not a figure. With data parallelism the ranks decode their
share of the batch in lockstep and the slowest rank counts.

With long prompts (``contexts``) a prefill costs more than the decode steps
that are timed, so each batch runs one generation instead: its full-batch
decode steps are cut into windows of ``decode_tokens``, the first a warm-up
and the next ``repeats`` the timings. ``profile_dir`` adds one more window
during which py-spy samples the engine's processes (see
``vllm_afd_dev.bench.host_profile``), after the timed ones, so that sampling slows none of
them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_afd_dev.bench.host_profile import HostProfiler
from vllm_afd_dev.bench.sessions import kill_session, wait_for_session_to_end
from vllm_afd_dev.harness.generate import ffn_placement, free_port, worker_env

_generation_ids = iter(range(10**9))

PROMPT_TOKENS = 16
"""The prompt length of a timed generation without ``contexts``."""
KV_SLACK_TOKENS = 64
"""KV cache room per sequence beyond its prompt and timed steps: the steps
before the whole batch decodes together and after the abort."""
SESSION_END_S = 120
"""How long the processes a configuration's worker started (an FFN rank
shutting down) may outlive it before they are killed."""


def sequence_tokens(decode_tokens: int, windows: int = 1, prompt: int = PROMPT_TOKENS) -> int:
    """The most tokens a sequence of ``measure`` holds: its prompt, ``windows``
    windows of ``decode_tokens`` steps and the slack; what its KV cache must
    hold for each sequence of a batch (``vllm_afd_dev.bench.gpu_memory``)."""
    return prompt + windows * decode_tokens + 1 + KV_SLACK_TOKENS


class TimingError(RuntimeError):
    """A generation that cannot be timed correctly."""


def decode_windows(
    llm, prompts: list, steps: int, windows: int = 1, on_window: Callable[[int], None] | None = None
) -> list[float]:
    """Decode ``prompts`` greedily until the whole batch has decoded together
    for ``windows`` runs of ``steps`` steps, then abort them; return the
    median step time of each window in ms (see the module docstring).
    ``on_window(i)`` is called as window ``i`` begins, and
    ``on_window(windows)`` as the last one ends."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    longest = engine.vllm_config.model_config.max_model_len - max(len(p["prompt_token_ids"])
                                                                  for p in prompts)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=longest, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    generation = next(_generation_ids)
    ids = [f"timed-{generation}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens_at: dict[float, int] = {}  # engine step timestamp -> sequences given a token
    full: list[float] = []  # timestamps of the steps that decoded the whole batch
    wanted = windows * steps + 1
    aborted = False
    # With data parallelism every rank's loop must run until all ranks are done.
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.metrics is None:
                raise TimingError("no request metrics: run the engine with disable_log_stats=False")
            stamp = out.metrics.last_token_ts
            tokens_at[stamp] = tokens_at.get(stamp, 0) + 1
            if tokens_at[stamp] == len(prompts):
                full.append(stamp)
                if on_window is not None and (len(full) - 1) % steps == 0:
                    on_window((len(full) - 1) // steps)
        if len(full) >= wanted and not aborted:
            engine.abort_request(ids)
            aborted = True
    if not aborted:
        raise TimingError(f"the batch of {len(prompts)} decoded together for only {len(full)} "
                          f"steps of the {wanted} asked (max_model_len too short?)")  # fmt: skip
    medians = []
    for w in range(windows):
        stamps = full[w * steps : (w + 1) * steps + 1]
        gaps = sorted(1000 * (b - a) for a, b in zip(stamps, stamps[1:], strict=False))
        medians.append(gaps[len(gaps) // 2])
    return medians


@dataclass
class Measurement:
    repeats: dict[int, list[float]]
    """Decode time per step (one output token per sequence) of each timed
    generation, by total batch."""
    weight_bytes: list[int]
    """Weight bytes of each rank's engine model (attention side under AFD)."""
    log: str
    """What the rank processes printed, spawned FFN ranks included."""
    profiles: dict[int, dict]
    """Rank 0's host profile by batch (``profile_dir``): the raw py-spy
    samples' path and the step time of the profiled window."""

    @property
    def ms_per_step(self) -> dict[int, float]:
        """The mean over the repeats, by total batch."""
        return {b: sum(r) / len(r) for b, r in self.repeats.items()}

    def spread(self, batch: int) -> float:
        """(max - min) / mean of the repeats at ``batch``."""
        r = self.repeats[batch]
        return (max(r) - min(r)) / (sum(r) / len(r))

    def log_values(self, pattern: str) -> list[float]:
        """Every number the log shows for a one-group ``pattern``."""
        return [float(v.replace(",", "")) for v in re.findall(pattern, self.log)]


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


def _prompts(batch: int, length: int) -> list[dict]:
    """``batch`` prompts of ``length`` tokens that share no prefix block."""
    return [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(length)]}
            for i in range(batch)]  # fmt: skip


def engine_core_pid(llm) -> int:
    """The pid of ``llm``'s engine core process (vLLM's multiprocess engine)."""
    return llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid


def _worker(args: argparse.Namespace) -> None:
    from vllm import LLM

    llm = LLM(model=str(args.model), disable_log_stats=False, **json.loads(args.engine_args))
    barrier = RankBarrier(args.sync_dir, args.rank, args.dp_size)
    ms = {}
    profiles = {}
    for batch, context in zip(args.batches, args.contexts or [None] * len(args.batches),
                              strict=True):  # fmt: skip
        if context is None:
            prompts = _prompts(batch, PROMPT_TOKENS)
            barrier.wait()
            decode_windows(llm, prompts, args.decode_tokens)  # warm-up: compilation, allocations
            ms[batch] = []
            for _ in range(args.repeats):
                barrier.wait()
                ms[batch] += decode_windows(llm, prompts, args.decode_tokens)
        else:
            windows = 1 + args.repeats + (args.profile_dir is not None)
            on_window = None
            if args.profile_dir is not None:
                profiler = HostProfiler(args.profile_dir, f"batch{batch}", engine_core_pid(llm))

                def on_window(i: int, profiler=profiler, last=windows - 1) -> None:
                    if i == last:
                        profiler.start()
                    elif i == last + 1:
                        profiler.stop()

            barrier.wait()
            timed = decode_windows(llm, _prompts(batch, context), args.decode_tokens, windows,
                                   on_window)  # fmt: skip
            ms[batch] = timed[1 : 1 + args.repeats]
            if on_window is not None:
                profiles[batch] = {"path": str(profiler.path), "ms_per_step": timed[-1]}
        print(f"batch {batch}: " + ", ".join(f"{t:.3f}" for t in ms[batch])
              + " ms per decode step", flush=True)  # fmt: skip
    placement = llm.apply_model(ffn_placement)[0]  # from its module: the engine imports it
    Path(args.out).write_text(json.dumps({"ms": ms, "weight_bytes": placement["weight_bytes"],
                                          "profiles": profiles}))  # fmt: skip


def measure(
    name: str,
    model: Path,
    engine_args: dict,
    batches: list[int],
    decode_tokens: int,
    dp_size: int = 1,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
    repeats: int = 3,
    contexts: list[int] | None = None,
    profile_dir: Path | None = None,
) -> Measurement:
    """Time ``engine_args`` on ``model``; with ``dp_size`` > 1, as vLLM's
    offline data parallel (one process per rank, rank r on GPU r), each rank
    decoding ``batch // dp_size`` sequences, all ranks starting each timed
    generation together. ``env`` is added to the processes' environment.
    ``contexts``: the prompt length at each batch, one generation per batch
    (see the module docstring); ``profile_dir``: where rank 0's host profiles
    go (needs ``contexts``)."""
    if profile_dir is not None and contexts is None:
        raise ValueError("host profiles are taken in a window of one generation: give contexts")
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
                   "--rank", str(rank), "--dp-size", str(dp_size), "--repeats", str(repeats),
                   "--batches", *(str(b // dp_size) for b in batches)]  # fmt: skip
            if contexts is not None:
                cmd += ["--contexts", *map(str, contexts)]
            if profile_dir is not None and rank == 0:
                cmd += ["--profile-dir", str(profile_dir)]
            with log.open("w") as sink:
                # A session of its own: everything it starts is waited for below.
                proc = subprocess.Popen(cmd, env=rank_env, stdout=sink, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            ranks.append((proc, out, log))
        deadline = time.monotonic() + timeout_s
        try:
            for proc, _, _ in ranks:
                try:
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for proc, _, _ in ranks:
                wait_for_session_to_end(proc.pid, SESSION_END_S, name)
        except KeyboardInterrupt:
            # A terminal's Ctrl-C reaches only its own session: end the others.
            for proc, _, _ in ranks:
                kill_session(proc.pid)
            raise
        log = "".join(f"== rank {r}\n{path.read_text()}" for r, (_, _, path) in enumerate(ranks))
        if any(proc.returncode != 0 or not out.is_file() for proc, out, _ in ranks):
            raise SystemExit(f"{name} failed:\n{log[-8000:]}")
        results = [json.loads(out.read_text()) for _, out, _ in ranks]
    return Measurement(
        # Lockstep ranks: each repeat took as long as its slowest rank.
        repeats={
            b: [max(ts) for ts in zip(*(r["ms"][str(b // dp_size)] for r in results), strict=True)]
            for b in batches
        },
        weight_bytes=[r["weight_bytes"] for r in results],
        log=log,
        profiles={int(b): p for b, p in results[0]["profiles"].items()},
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
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--profile-dir", type=Path)
    _worker(parser.parse_args())
