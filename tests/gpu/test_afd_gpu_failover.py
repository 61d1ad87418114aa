"""Failover on one H200 (``failover_timeout_s``): the ipc connector, both
roles on GPU 0, FULL_DECODE_ONLY graphs on both, on Model Runner V1 and on
Model Runner V2 (``runner``: ``VLLM_USE_V2_MODEL_RUNNER`` 0 or 1; the V1
cases skip on vLLM 0.34 on, which has no V1). On ipc the runner only
announces each step (V1's CUDAGraphWrapper replays and eager forwards, V2's
eager forwards and ``run_fullgraph`` replays): nothing is redone, so both
runners must give the same result.

Eight greedy sequences decode together while the FFN rank is killed
(SIGKILL) mid-run. The attention rank's forward in flight stays blocked on
the lost rank; once a replacement has mapped its buffer, it resumes that
forward at the layer its flags name, and the attention rank keeps replaying
its own graphs; the replacement captures the replayed layouts while
serving. The tokens must equal stock colocated vLLM's with the same
settings and runner, token for token. A standby takes the place of a
hand-started FFN rank having captured its graphs before the loss, against
the attention rank's buffer and flags mapped in advance, and replays them
from its first step on: with the same checkpoint the tokens equal stock's;
with a zeroed layer (the negative control) every sequence's tokens differ.
A micro-batched forward resumes each stage from its own layer.

On the nccl connector (both roles on GPU 0, each process an NCCL host of
its own, which NCCL joins through its network transport) the lost FFN
rank's communicator is aborted, the forward in flight runs again with a
hand-started replacement's new communicator, and the attention rank runs
eager from then on: its graphs hold the old communicator.

Failover on gloo (a redone forward, V1's ``_model_forward`` or V2's model
call, patch 0027) runs on the CPU only: the gloo connector moves CPU
tensors and is refused on a GPU (tests/e2e/test_afd_failover.py, V1).
"""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import (
    GenerationError,
    afd_engine_args,
    free_port,
    own_nccl_host,
    run,
    spawned_ffn_processes,
    token_differences,
)
from vllm_afd_dev.harness.gpu_settings import (
    engine,
    ffn_cli_args,
    graph_steps,
    micro_batching,
    micro_batching_env,
    model_engine,
    placement_env,
    runner_env,
)
from vllm_afd_dev.harness.launch import (
    RAN_AGAIN,
    TOOK_OVER,
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    ffn_server,
    generate_killing_ffn_ranks,
)
from vllm_afd_dev.models.tiny_model import with_zeroed_mlp

RUNNERS = ["V1", "V2"]
"""Model Runner V1 and V2, as the settings ``FULL_DECODE_ONLY-V1`` and
``FULL_DECODE_ONLY-V2`` select them."""
PROMPTS = [0, 1, 2, 3, 4, 5, 0, 2]
"""Eight sequences: the standard prompts, two of them twice."""
MAX_TOKENS = 1500
"""Several seconds of decoding: under MPS a step of the tiny model takes a
few milliseconds, and each kill comes 0.2 s after tokens flow again."""
FAILOVER_S = 90
TOOK_OVER_AFTER = re.compile(re.escape(TOOK_OVER) + r" ([\d.]+) s")
RESUMED_AT = re.compile(r"resumes step (\d+) at layer (\d+)")
"""A replacement's log line: where it answered the forward in flight."""


def setting(runner: str) -> str:
    return f"FULL_DECODE_ONLY-{runner}"


def engine_of(runner: str) -> dict:
    return dict(engine(setting(runner)), max_model_len=2048)


def env_of(runner: str) -> dict[str, str]:
    """The runner's environment, both roles on one GPU; a V1 case skips on a
    vLLM without V1."""
    return runner_env(setting(runner)) | placement_env("ipc-1gpu")


@functools.cache
def stock(model, runner: str) -> list:
    result = run(model, engine_of(runner), stock=True, env=env_of(runner),
                 max_tokens=MAX_TOKENS, prompts=PROMPTS)  # fmt: skip
    return result["tokens"]


def takeover_seconds(log: str) -> list[float]:
    return [float(s) for s in TOOK_OVER_AFTER.findall(log)]


def late_captures(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"late_captures=(\d+)", log)]


def wait_for_line(proc: subprocess.Popen, log: Path, line: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def killing_the_spawned_ffn_rank(
    model, args: dict, kills: int, env: dict, after_s: float = 0.2
) -> dict:
    """``run``'s result for the sequences of ``PROMPTS``, the spawned FFN
    rank SIGKILLed ``kills`` times mid-generation, each ``after_s`` after
    tokens flow (``generate_killing_ffn_ranks``)."""
    port = args["afd_config"]["port"]

    def kill_spawned() -> None:
        [ffn] = spawned_ffn_processes(port)
        ffn.send_signal(signal.SIGKILL)

    return generate_killing_ffn_ranks(model, args, kill_spawned, kills=kills, env=env,
                                      max_tokens=MAX_TOKENS, prompts=PROMPTS,
                                      timeout_s=400, after_s=after_s)  # fmt: skip


def ffn_logs(logs: list[Path]) -> str:
    return "".join(f"\n== {f.name}\n{f.read_text()}" for f in logs if f.is_file())


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_spawned_ffn_rank_killed_twice_loses_no_token(tiny_qwen3, runner, tmp_path):
    env = env_of(runner)
    args = afd_engine_args(engine_of(runner), connector="ipc", failover_timeout_s=FAILOVER_S,
                           stats_dir=str(tmp_path))  # fmt: skip
    afd = killing_the_spawned_ffn_rank(tiny_qwen3, args, kills=2, env=env)
    log = afd["log"]
    resumed = RESUMED_AT.findall(log)
    print(f"respawn: lost to connected {takeover_seconds(log)} s; resumed at (step, layer) "
          f"{resumed}; late captures {late_captures(log)}")  # fmt: skip
    assert len(takeover_seconds(log)) == 2 and len(resumed) == 2, failure_report(log)
    assert afd["tokens"] == stock(tiny_qwen3, runner), failure_report(log)
    # The last replacement (the one that shut down) served on in graphs it
    # captured itself.
    last = graph_steps(tmp_path, "FFN rank 0")
    assert last.late_captures > 0 and last.replays > 0, last
    assert last.replays_without_graph == 0, last


RESUMED_ROWS = re.compile(r"resumes step \d+ \(rows by stage \(\((\d+),\),\)\)")
"""A replacement's log line for a resumed step of one stage: its rows."""

KILL_AFTER_S = {"prefill": 0.0, "decode": 2.0}
"""When the kill comes after tokens flow: at once, in the first steps, which
prefill the prompts in chunks of ``max_num_batched_tokens`` rows; or 2 s on,
in the decode, one row per sequence (``PROMPTS``)."""


@functools.cache
def stock_qwen3_next(model, runner: str) -> list:
    result = run(model, qwen3_next_engine(runner), stock=True, env=env_of(runner),
                 max_tokens=MAX_TOKENS, prompts=PROMPTS)  # fmt: skip
    return result["tokens"]


@pytest.mark.parametrize("kill", list(KILL_AFTER_S))
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_model_with_recurrent_state_resumes_in_place(tiny_qwen3_next, runner, kill, tmp_path):
    """Qwen3-Next: each forward updates its recurrent state in place, so a
    redo would apply a step twice; on ipc the forward resumes in place, and
    the tokens equal stock's through a kill of the spawned FFN rank, in a
    chunked-prefill step or in a decode step (``kill``)."""
    env, engine_args = env_of(runner), qwen3_next_engine(runner)
    args = afd_engine_args(engine_args, connector="ipc", failover_timeout_s=FAILOVER_S)
    afd = killing_the_spawned_ffn_rank(tiny_qwen3_next, args, kills=1, env=env,
                                       after_s=KILL_AFTER_S[kill])  # fmt: skip
    log = afd["log"]
    resumed, rows = RESUMED_AT.findall(log), RESUMED_ROWS.findall(log)
    print(f"qwen3_next: lost to connected {takeover_seconds(log)} s; resumed at (step, layer) "
          f"{resumed}, rows {rows}")  # fmt: skip
    assert len(resumed) == 1 and len(rows) == 1, failure_report(log)
    in_decode = int(rows[0]) == len(PROMPTS)
    assert in_decode == (kill == "decode"), (
        f"the kill meant for a {kill} step came in a step of {rows[0]} rows: "
        f"change KILL_AFTER_S\n{failure_report(log)}"
    )
    reference = stock_qwen3_next(tiny_qwen3_next, runner)
    assert afd["tokens"] == reference, (
        f"{token_differences(afd['tokens'], reference)}\n{failure_report(log)}"
    )


STAGED_STEP = re.compile(r"resumes step \d+ \(rows by stage \(\((\d+),\), \((\d+),\)\)\)")
"""A replacement's log line for a resumed micro-batched step of two stages."""


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_micro_batched_forward_resumes_each_stage_in_place(tiny_qwen3, runner, tmp_path):
    """Micro-batch overlap in two stages (vLLM's batch-invariant kernels, as
    test_afd_gpu.py's overlap tests): the spawned FFN rank is killed once
    mid-decode, where every step is split; the replacement runs each stage
    of the forward in flight from the layer its own flags name, and the
    tokens equal stock's without overlap. (V2 micro-batches from vLLM 0.32
    on: skipped on 0.26; V1 skips from 0.34.)"""
    invariant = {"VLLM_BATCH_INVARIANT": "1"}
    env = micro_batching_env(setting(runner)) | placement_env("ipc-1gpu") | invariant
    overlap = dict(engine_of(runner), **micro_batching(2))
    args = afd_engine_args(overlap, connector="ipc", failover_timeout_s=FAILOVER_S,
                           stats_dir=str(tmp_path))  # fmt: skip
    afd = killing_the_spawned_ffn_rank(tiny_qwen3, args, kills=1, env=env)
    log = afd["log"]
    resumed, staged = RESUMED_AT.findall(log), STAGED_STEP.findall(log)
    print(f"micro-batched: lost to connected {takeover_seconds(log)} s; resumed at (step, "
          f"layer) {resumed}; rows by stage {staged}")  # fmt: skip
    assert len(resumed) == 1 and staged, failure_report(log)
    reference = run(tiny_qwen3, engine_of(runner), stock=True, env=env_of(runner) | invariant,
                    max_tokens=MAX_TOKENS, prompts=PROMPTS)["tokens"]  # fmt: skip
    assert afd["tokens"] == reference, failure_report(log)
    assert graph_steps(tmp_path, "attention rank 0").micro_batched > 0


def qwen3_next_engine(runner: str) -> dict:
    return dict(model_engine(setting(runner), "qwen3_next"), max_model_len=2048)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", ["same", "zeroed_layer"])
def test_a_standby_that_captured_in_advance_takes_over(tiny_qwen3, tmp_path, checkpoint, runner):
    """A hand-started FFN rank serves until it is killed; a standby, loaded
    in advance and with the served rank's graphs captured once it serves,
    takes its place and replays them. With the same checkpoint the tokens
    equal stock's; the negative control, a standby with layer 1's MLP
    zeroed, changes every sequence, so the comparison sees what the
    standby's graphs compute."""
    env = env_of(runner)
    port = free_port()
    ffn_args = ffn_cli_args(setting(runner))
    logs = [tmp_path / "ffn.log", tmp_path / "standby.log"]
    stats = {"stats_dir": str(tmp_path / "stats")}
    ffn = ffn_server(tiny_qwen3, port, logs[0], engine=ffn_args, connector="ipc", env=env, **stats)
    if checkpoint == "same":
        standby_model = tiny_qwen3
    else:
        standby_model = with_zeroed_mlp(tiny_qwen3, tmp_path / "zeroed", layer=1)
    args = attention_args(port, engine=engine_of(runner), connector="ipc",
                          failover_timeout_s=FAILOVER_S, **stats)  # fmt: skip
    standby = None
    try:
        # The standby after the FFN rank holds the port (it would take a free
        # one), and loaded before the kill (what a standby is for); it
        # captures once the FFN rank serves.
        wait_for_line(ffn, logs[0], "AFD FFN rank waiting for attention ranks")
        standby = ffn_server(standby_model, port, logs[1], engine=ffn_args, connector="ipc",
                             env=env, standby=True, **stats)  # fmt: skip
        wait_for_line(standby, logs[1], "to serve, to capture its graphs in advance")

        def kill_once_the_standby_captured() -> None:
            wait_for_line(standby, logs[1], "captured the graphs of", timeout_s=120)
            ffn.kill()

        try:
            afd = generate_killing_ffn_ranks(tiny_qwen3, args, kill_once_the_standby_captured,
                                             kills=1, env=env, max_tokens=MAX_TOKENS,
                                             prompts=PROMPTS)  # fmt: skip
        except GenerationError as e:  # what the FFN ranks said is in their own logs
            raise AssertionError(failure_report(e.output + ffn_logs(logs))) from None
        assert standby.wait(timeout=60) == 0  # told to shut down by the attention rank
    finally:
        for proc in (ffn, standby):
            if proc is not None:
                proc.kill()
    log = afd["log"] + ffn_logs(logs)
    print(f"standby: lost to connected {takeover_seconds(log)} s; late captures "
          f"{late_captures(log)}")  # fmt: skip
    assert len(takeover_seconds(log)) == 1, failure_report(log)
    if checkpoint == "same":
        assert afd["tokens"] == stock(tiny_qwen3, runner), failure_report(log)
    else:
        assert_every_prompt_changed(afd["tokens"], stock(tiny_qwen3, runner))
    # It served in the graphs it captured in advance, none captured late (the
    # killed rank wrote no record).
    took_over = graph_steps(tmp_path / "stats", "FFN rank 0")
    assert took_over.captures > 0 and took_over.replays > 0, took_over
    assert took_over.late_captures == 0 and took_over.replays_without_graph == 0, took_over


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("replacement", ["same", "zeroed_layer"])
def test_nccl_runs_the_lost_forward_again_with_a_replacement(
    tiny_qwen3, tmp_path, replacement, runner
):
    """nccl: the hand-started FFN rank is SIGKILLed mid-decode, 2 s after
    tokens flow; a replacement started by hand at its port forms a new
    communicator with the attention rank, which runs the lost forward again
    and every later step eager (its graphs hold the aborted communicator),
    at the graphs' token counts. With the same checkpoint the tokens equal
    stock's with graphs; the negative control, a replacement with layer 1's
    MLP zeroed, changes every sequence."""
    env = env_of(runner)
    port = free_port()
    ffn_args = ffn_cli_args(setting(runner))
    logs = [tmp_path / "ffn.log", tmp_path / "replacement.log"]
    checkpoint = tiny_qwen3
    if replacement == "zeroed_layer":
        checkpoint = with_zeroed_mlp(tiny_qwen3, tmp_path / "zeroed", layer=1)

    def ffn_rank(model, n: int) -> subprocess.Popen:
        return ffn_server(model, port, logs[n], engine=ffn_args, connector="nccl",
                          env=env | own_nccl_host(f"afd-ffn-{n}"))  # fmt: skip

    procs = [ffn_rank(tiny_qwen3, 0)]

    def kill_and_replace() -> None:
        procs[0].send_signal(signal.SIGKILL)
        procs.append(ffn_rank(checkpoint, 1))

    args = attention_args(port, engine=engine_of(runner), connector="nccl",
                          failover_timeout_s=FAILOVER_S)  # fmt: skip
    try:
        afd = generate_killing_ffn_ranks(tiny_qwen3, args, kill_and_replace, kills=1,
                                         env=env | own_nccl_host("afd-attention"),
                                         max_tokens=MAX_TOKENS, prompts=PROMPTS,
                                         timeout_s=400, after_s=2.0)  # fmt: skip
        assert procs[1].wait(timeout=60) == 0  # told to shut down by the attention rank
    except GenerationError as e:  # what the FFN ranks said is in their own logs
        raise AssertionError(failure_report(e.output + ffn_logs(logs))) from None
    finally:
        for proc in procs:
            proc.kill()
    log = afd["log"] + ffn_logs(logs)
    print(f"nccl {runner} {replacement}: lost to connected {takeover_seconds(log)} s, lost to "
          f"the lost step run again {RAN_AGAIN.findall(log)} s")  # fmt: skip
    assert len(takeover_seconds(log)) == 1 and len(RAN_AGAIN.findall(log)) == 1, failure_report(log)
    assert "runs their steps eager" in log, failure_report(log)
    if replacement == "same":
        assert afd["tokens"] == stock(tiny_qwen3, runner), failure_report(log)
    else:
        assert_every_prompt_changed(afd["tokens"], stock(tiny_qwen3, runner))
