"""Qwen3-Next under AFD on CPU: hybrid gated-delta-net (linear) and full
attention on the attention side, which keeps all their state; Qwen2-MoE's
routed experts and gated shared expert on the FFN rank.

vLLM's CPU kernels take this model only in bfloat16 ("CPU GDN attention
requires BF16"), with its recurrent state in float32 on CPUs without AMX
(the state's dtype otherwise mismatches in `chunk_gated_delta_rule_cpu`), so
both runs use those settings; the engine steps in the generating process, so
both see the same batches. Greedy tokens must equal stock vLLM's, and an FFN
rank with layer 1's MLP zeroed must change every prompt.
"""

from __future__ import annotations

import functools

import pytest

from afd_launch import assert_every_prompt_changed, attention_args, zeroed_ffn_rank
from generate import afd_engine_args, run

ENGINE = dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32")
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@functools.cache
def stock(model) -> list:
    return run(model, ENGINE, stock=True, env=ENV)["tokens"]


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
def test_qwen3_next_1a1f_matches_colocated(gate_on_attention, tiny_qwen3_next):
    args = afd_engine_args(ENGINE, compute_gate_on_attention=gate_on_attention)
    afd = run(tiny_qwen3_next, args, env=ENV)
    assert afd["remote_ffn_layers"] == 2
    gates = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert afd["local_mlp_params"] == (gates if gate_on_attention else [])
    assert afd["tokens"] == stock(tiny_qwen3_next)


def test_negative_control_zeroed_experts_change_qwen3_next_tokens(tiny_qwen3_next, tmp_path):
    ffn_args = ("--dtype", "bfloat16", "--enforce-eager")
    with zeroed_ffn_rank(tiny_qwen3_next, tmp_path, engine=ffn_args) as port:
        broken = run(tiny_qwen3_next, attention_args(port, engine=ENGINE), env=ENV)
    assert_every_prompt_changed(broken["tokens"], stock(tiny_qwen3_next))
