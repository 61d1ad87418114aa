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

import pytest

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    afd_engine_args,
    failure_report,
    run_dp,
    spawned_ffn_processes,
)
from vllm_afd_dev.harness.launch import (
    assert_deployment_ended_naming,
    assert_every_prompt_changed,
    attention_args,
    kill_attention_rank_mid_generation,
    serve_2a1f_to_concurrent_requests,
    zeroed_ffn_rank,
)

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
    assert len(shutdowns) == num_ffn_ranks, failure_report(result["log"])


def test_a_killed_attention_rank_ends_the_deployment(tiny_qwen3, tmp_path):
    """The data-parallel ranks of one deployment end together: vLLM 0.26.0
    ends every DP engine when one dies, so the FFN rank stops too and names
    the lost rank. Rank 0, killed, also started the FFN rank (spawn_ffn);
    the FFN rank outlives it to tell rank 1 why it stops. (A killed rank 1,
    on a host of its own: tests/e2e/test_afd_multi_node.py. Attention ranks
    as deployments of their own outlive each other:
    tests/e2e/test_afd_cpu_attention_loss.py.)"""
    victim, timeout_s = 0, 30
    engine = afd_engine_args(num_attention_ranks=2, num_ffn_ranks=1, timeout_s=timeout_s)
    port = engine["afd_config"]["port"]
    codes, elapsed, log = kill_attention_rank_mid_generation(
        tiny_qwen3, engine, UNEVEN["long-first"], victim, tmp_path, timeout_s + 60
    )
    print(f"every rank exited {elapsed:.1f} s after attention rank {victim} was killed")
    # the error itself, plus engine teardown
    assert_deployment_ended_naming(victim, codes, elapsed, log, port, timeout_s + 30)
    assert not spawned_ffn_processes(port, wait_s=30)


def test_negative_control_2a1f_with_a_zeroed_ffn_rank(tiny_qwen3, colocated, tmp_path):
    topology = {"num_attention_ranks": 2, "num_ffn_ranks": 1}
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, **topology) as port:
        broken = run_dp(tiny_qwen3, attention_args(port, **topology), UNEVEN["long-first"])
    assert_every_prompt_changed(broken["tokens"], colocated(tiny_qwen3)["tokens"])


def test_serve_data_parallel_answers_from_both_ranks(tiny_qwen3, tmp_path):
    engine = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
              "--gpu-memory-utilization", "0.3")  # fmt: skip
    serve_2a1f_to_concurrent_requests(tiny_qwen3, tmp_path, engine, 8, 8)
