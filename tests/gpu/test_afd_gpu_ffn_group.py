"""FFN rank groups on two GPUs: a tensor-parallel attention rank (TP 2, GPUs 0
and 1) served by one FFN rank of two processes (GPUs 1 and 0, each sharing
its GPU with one attention TP rank; only TP rank 0 and the group's leader
exchange, over ipc). The group splits the MoE experts by their intermediate
size (FFN TP 2) or shares them out whole (FFN EP 2, vLLM's expert
parallelism). Eager: FFN groups refuse graphs (docs/architecture.md).

Greedy tokens must equal stock vLLM at the same parallel sizes
(``tensor_parallel_size=2``, with ``enable_expert_parallel`` for EP), whose
shards and reductions are the same. Each group process must hold half of
the experts' bytes; the test prints them with each process's peak memory.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from generate import afd_engine_args, ffn_weight_bytes, run
from gpu_settings import engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def tp2_engine(mla: bool) -> dict:
    return engine("eager", mla) | {"tensor_parallel_size": 2}


GROUPS = {
    "ffn_tp2": {"ffn_tensor_parallel_size": 2},
    "ffn_ep2": {"ffn_tensor_parallel_size": 2, "ffn_enable_expert_parallel": True},
}
PEAK = re.compile(r"AFD FFN group rank (\d) of 2 on (\S+): peak device memory ([\d.]+) MiB")


@functools.cache
def stock_tp2(model, mla: bool, expert_parallel: bool) -> dict:
    return run(model, tp2_engine(mla) | {"enable_expert_parallel": expert_parallel}, stock=True)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_ffn_group_matches_stock_at_the_same_parallel_sizes(arch, group, request):
    model = request.getfixturevalue(f"tiny_{arch}")
    mla = arch == "deepseek_v2"
    afd = run(model, afd_engine_args(tp2_engine(mla), connector="ipc", **GROUPS[group]))
    stock = stock_tp2(model, mla, GROUPS[group].get("ffn_enable_expert_parallel", False))
    assert afd["tokens"] == stock["tokens"]
    shares = ffn_weight_bytes(afd["log"])
    peaks = PEAK.findall(afd["log"])
    print(f"  {arch} {group}: FFN weight bytes per process {shares}, peak memory {peaks}")
    assert len(shares) == 2 and shares[0] == shares[1]
    # A colocated TP rank holds the attention side's share plus the FFN's.
    assert afd["weight_bytes"] + shares[0] == stock["weight_bytes"]
    assert len(peaks) == 2 and {device for _, device, _ in peaks} == {"cuda:0", "cuda:1"}
