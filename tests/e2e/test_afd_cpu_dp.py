"""nA:mF on CPU: the attention ranks are the data-parallel ranks of one
deployment, stepping in lockstep; an FFN rank serves all of its peers in one
FFN call per layer.

Offline, one process per DP rank (VLLM_DP_RANK, VLLM_DP_SIZE, ...), the
prompts spread unevenly: one rank gets the long prompts and chunked
prefills, the other a single short prompt, so it idles (dummy batches) while
its peer still prefills and decodes. Every request's greedy tokens must
equal stock colocated vLLM's (float32, generated checkpoint).
"""

from __future__ import annotations

import ast
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from afd_launch import (
    assert_every_prompt_changed,
    attention_args,
    complete,
    failure_report,
    kill_attention_rank_mid_generation,
    serve,
    stop,
    wait_until_healthy,
    zeroed_ffn_rank,
)
from generate import PROMPTS, afd_engine_args, free_port, run_dp, spawned_ffn_processes

UNEVEN = {"long-first": [[0, 1, 2, 3, 4], [5]], "short-first": [[1], [0, 2, 3, 4, 5]]}


@pytest.mark.parametrize(
    ("num_ffn_ranks", "split"),
    [pytest.param(1, "long-first", marks=pytest.mark.every_release), (2, "short-first")],
    ids=["2A1F", "2A2F"],
)
def test_data_parallel_attention_matches_colocated(num_ffn_ranks, split, tiny_qwen3, colocated):
    topology = {"num_attention_ranks": 2, "num_ffn_ranks": num_ffn_ranks}
    result = run_dp(tiny_qwen3, afd_engine_args(**topology), UNEVEN[split])
    assert all(r["remote_ffn_layers"] == 2 and r["local_mlp_params"] == [] for r in result["ranks"])
    assert len(result["tokens"]) == len(PROMPTS)
    assert result["tokens"] == colocated(tiny_qwen3)["tokens"]
    # Each FFN rank served every one of its peers, and both ranks shut down.
    shutdowns = [ln for ln in result["log"].splitlines() if "shutdown after" in ln]
    assert len(shutdowns) == num_ffn_ranks, shutdowns


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-killed", "rank1-killed"])
def test_a_killed_attention_rank_ends_the_deployment(victim, tiny_qwen3, tmp_path):
    """Rank 0 also started the FFN rank (spawn_ffn); the FFN rank outlives it
    to tell rank 1 why it stops."""
    timeout_s = 30
    engine = afd_engine_args(num_attention_ranks=2, num_ffn_ranks=1, timeout_s=timeout_s)
    port = engine["afd_config"]["port"]
    codes, elapsed, log = kill_attention_rank_mid_generation(
        tiny_qwen3, engine, UNEVEN["long-first"], victim, tmp_path, timeout_s + 60
    )
    print(f"every rank exited {elapsed:.1f} s after attention rank {victim} was killed")
    survivor = 1 - victim
    lost = f"attention rank(s) [{victim}] disconnected without a shutdown message"
    said = failure_report(log)
    assert all(code != 0 for code in codes), (codes, said)
    assert f"AFD FFN rank 0: {lost}" in log, said
    # The survivor names the lost rank when the FFN rank's notice reaches it
    # first; vLLM's own per-step data-parallel all-reduce may fail first
    # (then the survivor's error is vLLM's, from its gloo group).
    named = (
        f"AFD attention rank {survivor}: lost the FFN rank at 127.0.0.1:{port} (the FFN rank "
        f"stopped the deployment: {lost}"
    )
    assert named in log or "coordinate_batch_across_dp" in log, said
    assert elapsed < timeout_s + 30, elapsed  # the error itself, plus engine teardown
    assert not spawned_ffn_processes(port, wait_s=30)


def test_negative_control_2a1f_with_a_zeroed_ffn_rank(tiny_qwen3, colocated, tmp_path):
    topology = {"num_attention_ranks": 2, "num_ffn_ranks": 1}
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, **topology) as port:
        broken = run_dp(tiny_qwen3, attention_args(port, **topology), UNEVEN["long-first"])
    assert_every_prompt_changed(broken["tokens"], colocated(tiny_qwen3)["tokens"])


def test_serve_data_parallel_answers_from_both_ranks(tiny_qwen3, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    afd = {"num_attention_ranks": 2, "num_ffn_ranks": 1, "spawn_ffn": True, "port": free_port()}
    server = serve(
        tiny_qwen3, port, log, "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "256", "--gpu-memory-utilization", "0.3",
        "--data-parallel-size", "2", "--afd-config", json.dumps(afd),
        # With data parallel, vLLM kills engines that have not exited when the
        # shutdown timeout (default 0 s) ends; give them time to stop the FFN rank.
        "--shutdown-timeout", "30",
    )  # fmt: skip
    try:
        wait_until_healthy(server, port, log)
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:  # concurrent, so both ranks get work
            answers = list(pool.map(lambda p: complete(port, tiny_qwen3, p), prompts))
        assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
    finally:
        stop(server)
    # The FFN rank shut down with the server and saw request tokens from both ranks.
    text = log.read_text()
    [shutdown] = [ln for ln in text.splitlines() if "AFD FFN rank 0: shutdown after" in ln]
    served = ast.literal_eval(shutdown.split("request tokens per attention rank: ")[1])
    assert served[0] > 0 and served[1] > 0, shutdown
