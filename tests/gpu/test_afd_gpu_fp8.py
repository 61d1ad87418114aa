"""AFD 1A1F on quantized checkpoints, on one GPU: FP8 blocks (DeepSeek-V3's
form) and MXFP4 experts (gpt-oss's).

The tiny Qwen3-MoE and DeepSeek-V3 (MLA, q-LoRA, sigmoid routing with a
correction bias) checkpoints rewritten by
scripts/fp8_checkpoint.py: e4m3 weights with 128x128 ``weight_scale_inv``
blocks in every attention and FFN linear layer, the routed experts in
FusedMoE's FP8 layout on the FFN rank. Greedy outputs must equal stock
colocated vLLM on the same checkpoint, token for token, eager and with
FULL_DECODE_ONLY graphs; a negative control breaks the FFN rank. The roles
talk over the ipc connector; written for one H200, which both roles share.
vLLM's CPU backend builds FP8 block linear layers only with AMX
(tests/unit/test_ffn_fp8.py), so this is where the whole path runs. Run as
the other GPU tests (docs/gpu.md).

gpt-oss ships its experts only in MXFP4 (scripts/mxfp4_checkpoint.py: FP4
blocks of 32 with power-of-two scales, the published layout), which the FFN
rank's MoE layer runs through vLLM's MXFP4 method, loaded by gpt-oss's own
loader; its router, attention and the experts' biases stay bfloat16.
"""

from __future__ import annotations

import functools

import pytest

from vllm_afd_dev.harness.generate import afd_engine_args, run
from vllm_afd_dev.harness.gpu_settings import (
    EAGER_AND_GRAPHS,
    check_step_counters,
    ffn_cli_args,
    model_engine,
    placement_env,
)
from vllm_afd_dev.harness.launch import assert_every_prompt_changed, attention_args, zeroed_ffn_rank

ONE_GPU = placement_env("ipc-1gpu")


@functools.cache
def stock(model, setting: str, arch: str) -> dict:
    return run(model, model_engine(setting, arch), stock=True, env=ONE_GPU)


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fp8_1a1f_matches_colocated(arch, setting, gate_on_attention, request, tmp_path):
    model = request.getfixturevalue(f"tiny_{arch}_fp8")
    args = afd_engine_args(
        model_engine(setting, arch),
        connector="ipc",
        compute_gate_on_attention=gate_on_attention,
        stats_dir=str(tmp_path),
    )
    afd = run(model, args, env=ONE_GPU)
    assert afd["remote_ffn_layers"] == 2
    assert all(name.endswith("mlp.gate.weight") for name in afd["local_mlp_params"])
    assert afd["tokens"] == stock(model, setting, arch)["tokens"]
    check_step_counters(tmp_path, setting)


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fp8_negative_control_zeroed_ffn_changes_tokens(arch, setting, request, tmp_path):
    """The comparison can fail: the FFN rank's layer-1 experts output zero
    (their FP8 down projections zeroed, the scales kept)."""
    model = request.getfixturevalue(f"tiny_{arch}_fp8")
    ffn_args = ffn_cli_args(setting)
    with zeroed_ffn_rank(model, tmp_path, engine=ffn_args, connector="ipc") as port:
        attention = attention_args(port, engine=model_engine(setting, arch), connector="ipc")
        broken = run(model, attention)
    assert_every_prompt_changed(broken["tokens"], stock(model, setting, arch)["tokens"])


MXFP4_FFN_OUTPUTS = ("experts.down_proj_blocks", "experts.down_proj_bias")
"""gpt-oss's MXFP4 experts' output: FP4 codes 0 (value 0) and no bias."""


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_mxfp4_gpt_oss_1a1f_matches_colocated(
    setting, gate_on_attention, tiny_gpt_oss_mxfp4, tmp_path
):
    model = tiny_gpt_oss_mxfp4
    args = afd_engine_args(
        model_engine(setting, "gpt_oss"),
        connector="ipc",
        compute_gate_on_attention=gate_on_attention,
        stats_dir=str(tmp_path),
    )
    afd = run(model, args, env=ONE_GPU)
    assert afd["remote_ffn_layers"] == 2
    assert all("mlp.router." in name for name in afd["local_mlp_params"])
    assert afd["tokens"] == stock(model, setting, "gpt_oss")["tokens"]
    check_step_counters(tmp_path, setting)


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_mxfp4_negative_control_zeroed_ffn_changes_tokens(setting, tiny_gpt_oss_mxfp4, tmp_path):
    """The comparison can fail: the FFN rank's layer-1 MXFP4 experts output
    zero (their down projections' codes and biases zeroed, the scales kept)."""
    model, ffn_args = tiny_gpt_oss_mxfp4, ffn_cli_args(setting)
    with zeroed_ffn_rank(
        model, tmp_path, engine=ffn_args, zeroed=MXFP4_FFN_OUTPUTS, connector="ipc"
    ) as port:
        attention = attention_args(port, engine=model_engine(setting, "gpt_oss"), connector="ipc")
        broken = run(model, attention)
    assert_every_prompt_changed(broken["tokens"], stock(model, setting, "gpt_oss")["tokens"])
