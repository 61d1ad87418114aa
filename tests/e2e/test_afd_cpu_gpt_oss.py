"""gpt-oss under AFD on CPU: attention with per-head sinks, alternating
sliding-window (16 tokens, shorter than most prompts) and full layers on the
attention side; every layer's MoE block (router with a bias, experts with
biases and the clamped SwiGLU) on the FFN rank, whose expert tensors load
through GptOssModel's own loader.

vLLM's CPU attention reads the sinks in bfloat16 whatever the model's dtype,
so a float32 engine fails in ``cpu_attention_with_kv_cache``; both runs use
bfloat16, in the generating process, so both see the same batches. Greedy
tokens must equal stock vLLM's, and an FFN rank whose layer-1 experts
output only their biases (down projections zeroed) must change every prompt.
"""

from __future__ import annotations

import functools

import pytest

from afd_launch import assert_every_prompt_changed, attention_args, zeroed_ffn_rank
from generate import afd_engine_args, run

ENGINE = dict(dtype="bfloat16")
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@functools.cache
def stock(model) -> list:
    return run(model, ENGINE, stock=True, env=ENV)["tokens"]


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
def test_gpt_oss_1a1f_matches_colocated(gate_on_attention, tiny_gpt_oss):
    args = afd_engine_args(ENGINE, compute_gate_on_attention=gate_on_attention)
    afd = run(tiny_gpt_oss, args, env=ENV)
    assert afd["remote_ffn_layers"] == 2
    routers = [f"model.layers.{i}.mlp.router.{p}" for i in range(2) for p in ("bias", "weight")]
    assert sorted(afd["local_mlp_params"]) == (routers if gate_on_attention else [])
    assert afd["tokens"] == stock(tiny_gpt_oss)


def test_negative_control_zeroed_experts_change_gpt_oss_tokens(tiny_gpt_oss, tmp_path):
    ffn_args = ("--dtype", "bfloat16", "--enforce-eager")
    with zeroed_ffn_rank(tiny_gpt_oss, tmp_path, engine=ffn_args, zeroed="down_proj") as port:
        broken = run(tiny_gpt_oss, attention_args(port, engine=ENGINE), env=ENV)
    assert_every_prompt_changed(broken["tokens"], stock(tiny_gpt_oss))
