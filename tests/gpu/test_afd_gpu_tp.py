"""A tensor-parallel attention rank on two GPUs: TP ranks on GPUs 0 and 1, the
FFN rank on GPU 1. Only TP rank 0 (GPU 0) exchanges hidden states with it,
over ipc (peer access) or nccl; TP rank 1 gets the FFN output through vLLM's
TP all-reduce, which FULL_DECODE_ONLY captures in the attention side's graphs.

Greedy tokens must equal stock vLLM at tensor_parallel_size 2. The FFN rank
computes each MLP whole while stock TP2 sums two shards of it, so the two
differ in the order of one reduction: the runs use float32 (TRITON_ATTN),
where that difference stays far below the greedy margin; bf16 equality
needs a tensor-parallel FFN rank with the same shards.
"""

from __future__ import annotations

import functools

import pytest
import torch

from afd_launch import assert_every_prompt_changed, attention_args, zeroed_ffn_rank
from generate import afd_engine_args, run
from gpu_settings import check_step_counters, engine, ffn_cli_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

FLOAT32_TP2 = dict(dtype="float32", attention_backend="TRITON_ATTN", tensor_parallel_size=2)


def tp2_engine(setting: str) -> dict:
    return engine(setting) | FLOAT32_TP2


@functools.cache
def stock_tp2(model, setting: str) -> dict:
    return run(model, tp2_engine(setting), stock=True)


@pytest.mark.parametrize("connector", ["ipc", "nccl"])
@pytest.mark.parametrize("setting", ["eager", "FULL_DECODE_ONLY"])
def test_tp2_attention_matches_stock_tp2(setting, connector, tiny_qwen3):
    afd = run(tiny_qwen3, afd_engine_args(tp2_engine(setting), connector=connector))
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert afd["tokens"] == stock_tp2(tiny_qwen3, setting)["tokens"]
    assert afd["log"].count("AFD attention rank 0 connected") == 1
    check_step_counters(afd["log"], setting)


def test_negative_control_tp2_with_a_zeroed_ffn_rank(tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    ffn_args = ffn_cli_args(setting, dtype="float32")
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, engine=ffn_args, connector="nccl") as port:
        broken = run(tiny_qwen3, attention_args(port, engine=tp2_engine(setting), connector="nccl"))
    assert_every_prompt_changed(broken["tokens"], stock_tp2(tiny_qwen3, setting)["tokens"])
