"""An FFN rank of two processes on CPU (``ffn_tensor_parallel_size`` 2): the
FFN of every layer split with vLLM's tensor parallelism, or its MoE experts
split by their intermediate size, behind one connector.

The attention side runs tensor-parallel too (TP 2), so the colocated
reference is stock vLLM at ``tensor_parallel_size=2``: both deployments split every
weight the same way and reduce in the same order, and greedy tokens must be
equal (float32, chunked prefill mixed with decode, generated checkpoints).
Each group process must hold only its share of the FFN weights. The negative
control serves the same attention side from an FFN group with one layer's
MLP zeroed.

Here: a dense model with bound threads, and a MoE model with the router gate
on the attention side (its logits reach both group processes). MoE groups
with the gate on the FFN side, DeepSeek-V2's included, with tensor and with
expert parallelism, run on GPUs (tests/gpu/test_afd_gpu_ffn_group.py, also
on one GPU).
"""

from __future__ import annotations

import functools
import os

import pytest

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    afd_engine_args,
    ffn_bytes_read,
    ffn_weight_bytes,
    run,
)
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    checkpoint_ffn_bytes,
    failure_report,
    zeroed_ffn_rank,
)

TP2 = {"tensor_parallel_size": 2}
FFN_TP2 = {"ffn_tensor_parallel_size": 2}
# vLLM binds each CPU worker's OpenMP threads as VLLM_CPU_OMP_THREADS_BIND
# says, and the FFN side's processes follow the same setting: with "0|1" the
# attention workers and, on their side, the FFN group's processes take core 0
# and core 1. The other cases leave threads unbound ("nobind").
BOUND = "0|1"
# Expert parallelism runs on GPUs only (tests/gpu/test_afd_gpu_ffn_group.py):
# vLLM's CPU backend has none.
CASES = {
    "qwen3-bound": ("qwen3", FFN_TP2, BOUND),
    "qwen3_moe-gate_attn": (
        "qwen3_moe",
        FFN_TP2 | {"compute_gate_on_attention": True},
        "nobind",
    ),
}


def run_env(cores: str) -> dict[str, str]:
    """A generation process's environment: its thread binding."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cores}


@functools.cache
def stock_tp2(model, cores: str) -> dict:
    return run(model, TP2, stock=True, env=run_env(cores))


@pytest.mark.parametrize("case", CASES)
def test_ffn_group_matches_colocated_at_the_same_parallel_sizes(case, request):
    arch, afd_args, cores = CASES[case]
    model = request.getfixturevalue(f"tiny_{arch}")
    afd = run(model, afd_engine_args(TP2, **afd_args), env=run_env(cores))
    stock = stock_tp2(model, cores)
    assert len(afd["tokens"]) == len(PROMPTS)
    assert afd["tokens"] == stock["tokens"]
    log = afd["log"]
    assert "AFD FFN rank 0: shutdown after" in log, failure_report(log)
    assert "AFD FFN group rank 1: shutdown after" in log, failure_report(log)
    # Each FFN process is bound as vLLM binds its TP workers: one core each
    # from the "0|1" lists, or left on every core this machine allows.
    unbound = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    places = ["0", "1"] if cores == BOUND else [unbound, unbound]
    for group_rank, where in enumerate(places):
        said = f"AFD FFN rank 0, group rank {group_rank}: "
        bound = [ln for ln in log.splitlines() if said in ln]
        assert len(bound) == 1 and bound[0].endswith(f"on cores {where}"), failure_report(log)
    # The two processes hold equal shares: half of the FFN's checkpoint bytes,
    # plus the replicated router gate.
    shares = ffn_weight_bytes(log)
    print(f"  {case}: FFN weight bytes per group process {shares}")
    gate_on_attention = afd_args.get("compute_gate_on_attention", False)
    split, replicated = checkpoint_ffn_bytes(model, gate_on_attention)
    assert shares == [split // 2 + replicated] * 2
    # Each reads every FFN tensor of the checkpoint (vLLM's tensor-parallel
    # loaders take their slice of each), and nothing else.
    assert ffn_bytes_read(log) == [split + replicated] * 2


def test_negative_control_ffn_group_with_a_zeroed_mlp(tiny_qwen3, tmp_path):
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, **FFN_TP2) as port:
        broken = run(tiny_qwen3, attention_args(port, engine=TP2, **FFN_TP2), env=run_env(BOUND))
    assert_every_prompt_changed(broken["tokens"], stock_tp2(tiny_qwen3, BOUND)["tokens"])
