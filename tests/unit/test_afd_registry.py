"""What the registry says of an architecture: the FFN's name in each
decoder layer, the checkpoint names the FFN side loads, and the refusal
where the model file has no hook. MiniMax-M3's model imports CUDA-only ops,
so these read its spec and checkpoint without building it (its GPU run:
tests/gpu/test_afd_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import vllm
from safetensors.torch import load_file
from vllm.afd.models.families import minimax_m3_refusal
from vllm.afd.models.registry import get_afd_model_spec
from vllm.transformers_utils.config import get_config

MINIMAX_M3 = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")


@pytest.fixture(scope="module")
def minimax_m3_text_config(tiny_minimax_m3):
    return get_config(str(tiny_minimax_m3), trust_remote_code=False).get_text_config()


@pytest.mark.parametrize("architecture", MINIMAX_M3)
def test_minimax_m3_names_each_layers_ffn_as_its_checkpoint(
    architecture, minimax_m3_text_config, tiny_minimax_m3
):
    """A dense layer's FFN is ``mlp``, a MoE layer's ``block_sparse_moe``
    (``moe_layer_freq``), as the checkpoint names them; one name per
    architecture elsewhere."""
    spec = get_afd_model_spec(architecture)
    config = minimax_m3_text_config
    names = [spec.layer_ffn_name(config, i) for i in range(config.num_hidden_layers)]
    assert names == ["mlp", "block_sparse_moe", "block_sparse_moe"]
    assert [spec.routing.is_moe_layer(config, i) for i in range(3)] == [False, True, True]
    assert spec.routing.remote_parts == ("experts", "shared_experts")
    # float32 logits of 8 experts: 16 bf16 columns
    assert spec.routing.router_logit_columns(config, torch.bfloat16) == 16
    in_layers = [n.split(".") for n in load_file(tiny_minimax_m3 / "model.safetensors")]
    for parts in (p for p in in_layers if p[:2] == ["model", "layers"]):
        layer, part = int(parts[2]), parts[3]
        assert part in ("self_attn", "input_layernorm", "post_attention_layernorm", names[layer])
    assert get_afd_model_spec("MiniMaxM2ForCausalLM").layer_ffn_name(config, 0) == (
        "block_sparse_moe"
    )
    assert get_afd_model_spec("Qwen3ForCausalLM").layer_ffn_name(config, 0) == "mlp"
    assert get_afd_model_spec("LongcatFlashForCausalLM").layer_ffn_name(config, 0) is None


@pytest.mark.parametrize(
    ("architecture", "parent"), [(MINIMAX_M3[0], ""), (MINIMAX_M3[1], "language_model.")]
)
def test_minimax_m3_ffn_tensors_map_to_the_ffn_sides_parameters(
    architecture, parent, minimax_m3_text_config
):
    """What MiniMax-M3's own loading loop does by hand: the dense MLP's and
    the shared expert's gate and up projections stacked, the routed
    experts' w1/w3/w2 under FusedMoE's names, block scales' names; the
    vision-language checkpoint's decoder layers under
    ``language_model.model.``."""
    mapper = get_afd_model_spec(architecture).weights_mapper(minimax_m3_text_config)
    block, mlp = f"{parent}model.layers.1.block_sparse_moe", f"{parent}model.layers.0.mlp"
    expected = {
        f"{mlp}.gate_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", 0),
        f"{mlp}.up_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", 1),
        f"{mlp}.down_proj.weight": ("model.layers.0.mlp.down_proj.weight", None),
        f"{block}.shared_experts.up_proj.weight": (
            "model.layers.1.block_sparse_moe.shared_experts.gate_up_proj.weight", 1),
        f"{block}.experts.7.w1.weight": (
            "model.layers.1.block_sparse_moe.experts.7.gate_proj.weight", None),
        f"{block}.experts.7.w3.weight": (
            "model.layers.1.block_sparse_moe.experts.7.up_proj.weight", None),
        f"{block}.experts.7.w2.weight_scale_inv": (
            "model.layers.1.block_sparse_moe.experts.7.down_proj.weight_scale", None),
        f"{block}.e_score_correction_bias": (
            "model.layers.1.block_sparse_moe.e_score_correction_bias", None),
        f"{block}.gate.weight": ("model.layers.1.block_sparse_moe.gate.weight", None),
    }  # fmt: skip
    for name, mapped in expected.items():
        assert mapper._map_name_with_shard(name) == mapped, name


def test_minimax_m3_is_refused_where_its_model_file_has_no_hook(pristine_cuda, monkeypatch):
    """This tree carries patch 0032: no refusal. A tree whose MiniMax-M3
    model has no hook (stock vLLM 0.26.0's, as 0.34.0's where the series
    leaves the patch out) is refused, naming the model and the releases to
    use; without the refusal the attention side would run the FFNs itself.
    The model file is read, not imported: it imports CUDA-only ops."""
    assert minimax_m3_refusal() is None
    monkeypatch.setattr(vllm, "__file__", str(pristine_cuda / "vllm" / "__init__.py"))
    refusal = minimax_m3_refusal()
    assert refusal is not None and "has no AFD hook" in refusal, refusal
    assert "vllm.models.minimax_m3.nvidia.model" in refusal and "vLLM 0.26.0" in refusal
    assert get_afd_model_spec(MINIMAX_M3[1]).refusal() == refusal


def test_only_a_stand_in_says_its_output_arrives_reduced(one_process_world):
    """MiniMax-M3's decoder layer asks ``is_remote_ffn`` before it asks its
    FFN whether the FFN's all-reduce is deferred: a stand-in answers for
    itself (its output arrives reduced), a built FFN is asked as upstream
    asks it."""
    from torch import nn
    from vllm.afd.models.remote_ffn import RemoteFFN, RemoteMoE, is_remote_ffn

    gate = nn.Linear(4, 2)
    moe = RemoteMoE(1, gate, "gate", ("experts",), lambda g, x: g(x), torch.float32)
    assert is_remote_ffn(RemoteFFN(0)) and is_remote_ffn(moe)
    assert not is_remote_ffn(gate)
