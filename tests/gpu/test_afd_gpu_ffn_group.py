"""FFN rank groups on two GPUs: a tensor-parallel attention rank (TP 2, GPUs 0
and 1) served by one FFN rank of two processes (GPUs 1 and 0, each sharing
its GPU with one attention TP rank; only TP rank 0 and the group's leader
exchange, over ipc). The group splits the MoE experts by their intermediate
size (FFN TP 2) or shares them out whole (FFN EP 2, vLLM's expert
parallelism). Eager: FFN groups refuse graphs (docs/architecture.md).

Greedy tokens must equal stock vLLM at the same parallel sizes
(``tensor_parallel_size=2``, with ``enable_expert_parallel`` for EP), whose
shards and reductions are the same. Each group process must hold half of
the experts' bytes, and with EP read only its half of the experts from the
checkpoint; the test prints both with each process's peak memory.

On four GPUs, the same FFN EP 2 group runs on GPUs of its own (2 and 3,
``ffn_first_device``), started by hand, with nccl between the roles.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from afd_launch import attention_args, checkpoint_expert_bytes, checkpoint_ffn_bytes, ffn_server
from generate import (
    afd_engine_args,
    failure_report,
    ffn_bytes_read,
    ffn_weight_bytes,
    free_port,
    run,
)
from gpu_settings import engine, ffn_cli_args

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
    # Checkpoint bytes read per process: every FFN tensor with tensor
    # parallelism (the loaders slice them); with expert parallelism half of
    # the experts' tensors, left unread by the other process.
    ffn_bytes = sum(checkpoint_ffn_bytes(model, gate_on_attention=False))
    expert_parallel = GROUPS[group].get("ffn_enable_expert_parallel", False)
    unread = checkpoint_expert_bytes(model) // 2 if expert_parallel else 0
    reads = ffn_bytes_read(afd["log"])
    print(f"  {arch} {group}: checkpoint bytes read per process {reads} of {ffn_bytes}")
    assert reads == [ffn_bytes - unread] * 2


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_attention_tp2_and_ffn_ep2_on_their_own_gpus_over_nccl(arch, request, tmp_path):
    """Four GPUs, each process on its own: attention TP 2 on GPUs 0 and 1, the
    FFN rank's two expert-parallel processes on GPUs 2 and 3, started by hand
    (``ffn_first_device``, as README says for tensor-parallel attention
    ranks on the same node), exchanging over nccl."""
    model = request.getfixturevalue(f"tiny_{arch}")
    mla = arch == "deepseek_v2"
    port, log = free_port(), tmp_path / "ffn.log"
    group = GROUPS["ffn_ep2"] | {"connector": "nccl"}
    ffn = ffn_server(model, port, log, engine=ffn_cli_args("eager"), ffn_first_device=2, **group)
    try:
        args = attention_args(port, engine=tp2_engine(mla), **group)
        afd = run(model, args)
        assert ffn.wait(timeout=60) == 0, failure_report(log.read_text())
    finally:
        ffn.kill()
    assert afd["tokens"] == stock_tp2(model, mla, True)["tokens"]
    ffn_log = log.read_text()
    shares, peaks = ffn_weight_bytes(ffn_log), PEAK.findall(ffn_log)
    print(f"  {arch}: FFN weight bytes per process {shares}, peak memory {peaks}")
    assert len(shares) == 2 and shares[0] == shares[1]
    assert len(peaks) == 2 and {device for _, device, _ in peaks} == {"cuda:2", "cuda:3"}
