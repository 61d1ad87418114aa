"""nA:mF on GPUs: two attention ranks (data parallel), and
- on one GPU, both of them and one FFN rank sharing GPU 0 over the ipc
  connector (each DP rank as if on a one-GPU node of its own);
- with the ranks on GPUs 0 and 1, on two GPUs, one FFN rank sharing GPU 0
  with attention rank 0 over the ipc connector, so attention rank 1 reaches
  it across GPUs (peer access);
- on three or more, one FFN rank on GPU 2 over nccl (2A1F);
- on four or more, FFN ranks on GPUs 2 and 3 over nccl (2A2F).

The prompts are split unevenly (one rank prefills the long prompts while the
other decodes one short prompt, then idles on dummy steps), so steps occur
whose per-peer token counts differ from a captured graph's but add up to
its total. vLLM pads every data-parallel rank to the same token count when
all of them run a graph, so such steps are eager mixed steps: with a step
budget of 7 tokens per rank, a full prefill step of one rank (7) and the
other rank's one token add up to 8, the total of the 4 + 4 decode graph
(the captured sizes are 1 to 7 per rank).
Every rank's greedy tokens must equal stock vLLM run on that rank's share.
The FFN rank computes each token in a batch of both ranks' tokens, so both
runs use vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``; the FFN
rank follows it too).
"""

from __future__ import annotations

import functools
import json

import pytest

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    afd_engine_args,
    run,
    run_dp,
    spawned_ffn_processes,
)
from vllm_afd_dev.harness.gpu_settings import (
    EAGER_AND_GRAPHS,
    check_step_counters,
    engine,
    ffn_cli_args,
    graph_steps,
    needs_gpus,
    two_gpus,
    uses_graphs,
)
from vllm_afd_dev.harness.launch import (
    assert_deployment_ended_naming,
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    kill_attention_rank_mid_generation,
    serve_2a1f_to_concurrent_requests,
    zeroed_ffn_rank,
)

UNEVEN = [[0, 1, 2, 3, 4], [5]]
TWO_RANKS = {"num_attention_ranks": 2, "num_ffn_ranks": 1, "connector": "ipc"}
# The FFN ranks take the GPUs after the attention ranks' (ffn_device_index),
# wrapping around: on one GPU every rank shares GPU 0.
TOPOLOGIES = {
    "2A1F-ipc-1gpu": (TWO_RANKS, 1),
    "2A1F-ipc": (TWO_RANKS, 2),
    "2A1F-nccl": (TWO_RANKS | {"connector": "nccl"}, 3),
    "2A2F-nccl": (TWO_RANKS | {"connector": "nccl", "num_ffn_ranks": 2}, 4),
}
BATCH_INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}


STEP_BUDGET = 7


def dp_engine(setting: str) -> dict:
    return engine(setting) | {"max_num_batched_tokens": STEP_BUDGET, "max_num_seqs": STEP_BUDGET}


@functools.cache
def stock_per_share(model, setting: str) -> list[list[int]]:
    """Stock vLLM on each rank's share, in prompt order."""
    by_prompt = {}
    for share in UNEVEN:
        result = run(model, dp_engine(setting), stock=True, prompts=share, env=BATCH_INVARIANT)
        by_prompt.update(zip(share, result["tokens"], strict=True))
    return [by_prompt[i] for i in sorted(by_prompt)]


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize(
    "topology",
    [
        pytest.param(name, marks=needs_gpus(gpus))
        for name, (_, gpus) in TOPOLOGIES.items()
    ],
)  # fmt: skip
def test_data_parallel_attention_matches_stock_on_each_share(
    topology, setting, tiny_qwen3, tmp_path
):
    afd_config, gpus = TOPOLOGIES[topology]
    args = afd_engine_args(dp_engine(setting), stats_dir=str(tmp_path), **afd_config)
    afd = run_dp(tiny_qwen3, args, UNEVEN, env=BATCH_INVARIANT, one_gpu=gpus == 1)
    assert len(afd["tokens"]) == len(PROMPTS)
    assert afd["tokens"] == stock_per_share(tiny_qwen3, setting), failure_report(afd["log"])
    check_step_counters(tmp_path, setting, 2, afd_config["num_ffn_ranks"], STEP_BUDGET)
    ffn = graph_steps(tmp_path, "FFN rank 0")
    if uses_graphs(setting) and afd_config["num_ffn_ranks"] == 1:
        # Steps split 7 + 1 beside a graph of 4 + 4 happened and ran eager.
        assert ffn.peer_split_at_graph_total > 0, ffn


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=two_gpus)])
def test_negative_control_2a1f_with_a_zeroed_ffn_rank(gpus, tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, engine=ffn_cli_args(setting), **TWO_RANKS) as port:
        args = attention_args(port, engine=dp_engine(setting), **TWO_RANKS)
        broken = run_dp(tiny_qwen3, args, UNEVEN, env=BATCH_INVARIANT, one_gpu=gpus == 1)
    assert_every_prompt_changed(broken["tokens"], stock_per_share(tiny_qwen3, setting))


@two_gpus
def test_serve_data_parallel_answers_from_both_ranks(tiny_qwen3, tmp_path):
    """`vllm serve --data-parallel-size 2` with FULL_DECODE_ONLY graphs: DP
    rank r on GPU r, the spawned FFN rank on GPU 0."""
    graphs = dict(engine("FULL_DECODE_ONLY")["compilation_config"])
    cli = ("--dtype", "bfloat16", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(2**30), "--gpu-memory-utilization", "0.25",
           "--compilation-config", json.dumps(graphs))  # fmt: skip
    record = serve_2a1f_to_concurrent_requests(tiny_qwen3, tmp_path, cli, 16, 32, connector="ipc")
    ffn = record.graph_steps
    print(f"  ffn: {ffn}")
    assert ffn.replays > 0 and ffn.replays_without_graph == 0


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=two_gpus)])
def test_a_killed_attention_rank_ends_the_deployment(gpus, tiny_qwen3, tmp_path):
    """Attention rank 1 (on GPU 0 with every rank, or alone on GPU 1) is
    killed while both ranks wait inside graph replays; the FFN rank and rank
    0 exit naming it, within the bound."""
    timeout_s = 60  # also bounds the FFN rank's start on a busy machine
    long_run = dict(engine("FULL_DECODE_ONLY"), max_model_len=2048)
    args = afd_engine_args(long_run, timeout_s=timeout_s, **TWO_RANKS)
    port = args["afd_config"]["port"]
    codes, elapsed, log = kill_attention_rank_mid_generation(
        tiny_qwen3, args, UNEVEN, 1, tmp_path, timeout_s + 60, max_tokens=1900, one_gpu=gpus == 1
    )
    print(f"every rank exited {elapsed:.1f} s after attention rank 1 was killed")
    assert_deployment_ended_naming(1, codes, elapsed, log, port, timeout_s + 30)
    assert not spawned_ffn_processes(port, wait_s=30)
