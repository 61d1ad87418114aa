"""A tensor-parallel attention rank (TP 2) served by one FFN rank. Only TP
rank 0 exchanges hidden states with it; TP rank 1 gets the FFN output
through vLLM's TP all-reduce, which FULL_DECODE_ONLY captures in the
attention side's graphs.

On two GPUs: TP ranks on GPUs 0 and 1, the FFN rank on GPU 1, over ipc (peer
access) or nccl, against stock vLLM at tensor_parallel_size 2.

On one GPU (a test placement, ``run_tp_ranks_on_one_gpu``): both TP ranks and
the FFN rank on GPU 0, over ipc; each TP rank is its own engine process,
started as vLLM's ``external_launcher`` backend expects, and so is stock
vLLM's TP 2 reference.

Greedy tokens must equal stock vLLM at TP 2. The FFN rank computes each MLP
whole while stock TP2 sums two shards of it, so the two differ in the order
of one reduction: the runs use float32 (TRITON_ATTN), where that difference
stays far below the greedy margin; bf16 equality needs a tensor-parallel FFN
rank with the same shards (tests/gpu/test_afd_gpu_ffn_group.py).
"""

from __future__ import annotations

import functools
import signal

import pytest

from vllm_afd_dev.harness.generate import afd_engine_args, run, spawned_ffn_processes
from vllm_afd_dev.harness.gpu_settings import (
    EAGER_AND_GRAPHS,
    check_step_counters,
    engine,
    ffn_cli_args,
    placement_env,
    two_gpus,
)
from vllm_afd_dev.harness.launch import (
    TOOK_OVER,
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    generate_killing_ffn_ranks,
    run_tp_ranks_on_one_gpu,
    running_ffn_rank,
    zeroed_ffn_rank,
)

ONE_GPU = placement_env("ipc-1gpu")

FAILOVER_TOKENS = 1500
"""Seconds of decoding: the kill comes 0.2 s after tokens flow."""
FLOAT32_TP2 = dict(dtype="float32", attention_backend="TRITON_ATTN", tensor_parallel_size=2)


def tp2_engine(setting: str) -> dict:
    return engine(setting) | FLOAT32_TP2


@functools.cache
def stock_tp2(model, setting: str) -> dict:
    return run(model, tp2_engine(setting), stock=True)


@two_gpus
@pytest.mark.parametrize("connector", ["ipc", "nccl"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_tp2_attention_matches_stock_tp2(setting, connector, tiny_qwen3, tmp_path):
    args = afd_engine_args(tp2_engine(setting), connector=connector, stats_dir=str(tmp_path))
    afd = run(tiny_qwen3, args)
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert afd["tokens"] == stock_tp2(tiny_qwen3, setting)["tokens"]
    assert afd["log"].count("AFD attention rank 0 connected") == 1
    check_step_counters(tmp_path, setting)


@two_gpus
def test_negative_control_tp2_with_a_zeroed_ffn_rank(tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    ffn_args = ffn_cli_args(setting, dtype="float32")
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, engine=ffn_args, connector="nccl") as port:
        broken = run(tiny_qwen3, attention_args(port, engine=tp2_engine(setting), connector="nccl"))
    assert_every_prompt_changed(broken["tokens"], stock_tp2(tiny_qwen3, setting)["tokens"])


@two_gpus
def test_tp2_attention_resumes_in_place_when_its_ffn_rank_is_killed(tiny_qwen3):
    """Failover (ipc): TP rank 0's forward stays blocked on the lost FFN
    rank's flags and TP rank 1's in the TP all-reduce, where no error
    reaches it; the replacement answers from the layer the flags name, so
    both resume the same forward, and the tokens equal stock TP 2's."""
    long_run = dict(tp2_engine("FULL_DECODE_ONLY"), max_model_len=2048)
    args = afd_engine_args(long_run, connector="ipc", failover_timeout_s=90)
    port = args["afd_config"]["port"]

    def kill_spawned() -> None:
        [ffn] = spawned_ffn_processes(port)
        ffn.send_signal(signal.SIGKILL)

    afd = generate_killing_ffn_ranks(tiny_qwen3, args, kill_spawned, kills=1,
                                     max_tokens=FAILOVER_TOKENS, timeout_s=400)  # fmt: skip
    assert afd["log"].count(TOOK_OVER) == 1, failure_report(afd["log"])
    stock = run(tiny_qwen3, long_run, stock=True, max_tokens=FAILOVER_TOKENS)
    assert afd["tokens"] == stock["tokens"], failure_report(afd["log"])


@functools.cache
def stock_tp2_on_one_gpu(model, setting: str) -> dict:
    return run_tp_ranks_on_one_gpu(model, tp2_engine(setting), stock=True, env=ONE_GPU)


def one_gpu_ffn_rank(setting: str, **afd) -> dict:
    return dict(engine=ffn_cli_args(setting, dtype="float32"), env=ONE_GPU, connector="ipc", **afd)


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_tp2_attention_sharing_one_gpu_matches_stock_tp2(setting, tiny_qwen3, tmp_path):
    stats = {"stats_dir": str(tmp_path)}
    with running_ffn_rank(tiny_qwen3, tmp_path, **one_gpu_ffn_rank(setting, **stats)) as (
        port,
        log,
    ):
        attention = attention_args(port, engine=tp2_engine(setting), connector="ipc", **stats)
        afd = run_tp_ranks_on_one_gpu(tiny_qwen3, attention, env=ONE_GPU)
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert afd["tokens"] == stock_tp2_on_one_gpu(tiny_qwen3, setting)["tokens"]
    ffn_log = log.read_text()
    assert ffn_log.count("attention rank 0 connected") == 1
    check_step_counters(tmp_path, setting)


def test_negative_control_tp2_sharing_one_gpu_with_a_zeroed_ffn_rank(tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, **one_gpu_ffn_rank(setting)) as port:
        attention = attention_args(port, engine=tp2_engine(setting), connector="ipc")
        broken = run_tp_ranks_on_one_gpu(tiny_qwen3, attention, env=ONE_GPU)
    reference = stock_tp2_on_one_gpu(tiny_qwen3, setting)["tokens"]
    assert_every_prompt_changed(broken["tokens"], reference)
