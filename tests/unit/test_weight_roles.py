"""Each AFD role reads only its own tensors of a multi-file checkpoint.

vLLM's own safetensors iterator runs over a three-file copy of the tiny
Qwen3-MoE checkpoint, and of its FP8 block-quantized form (each quantized
weight with its ``weight_scale_inv``), with each role's config current. A spy around its
``safe_open`` (the real files are read) records every tensor it reads and
how many bytes that tensor holds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vllm.afd.models.weight_roles import is_ffn_weight
from vllm.config import set_current_vllm_config
from vllm.config.afd import AFDConfig
from vllm.model_executor.model_loader import weight_utils


@pytest.fixture(params=["tiny_qwen3_moe", "tiny_qwen3_moe_fp8"], ids=["float", "fp8"])
def qwen3_moe_checkpoint(request) -> Path:
    """The tiny Qwen3-MoE checkpoint as generated, and in DeepSeek-V3's FP8
    block form."""
    return request.getfixturevalue(request.param)


def sharded_copy(model: Path, out: Path, num_files: int = 3) -> list[Path]:
    """``model`` with its tensors spread, in name order, over ``num_files``
    files, with the index a multi-file checkpoint carries."""
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(path))
    names = sorted(tensors)
    out.mkdir()
    for path in model.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, out / path.name)
    weight_map, files = {}, []
    for i in range(num_files):
        part = names[i * len(names) // num_files : (i + 1) * len(names) // num_files]
        file = out / f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file.name))
        files.append(file)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return files


def read_by_role(files: list[Path], afd: AFDConfig | None, monkeypatch, **config) -> dict[str, int]:
    """The tensors vLLM's iterator reads with ``afd`` (and the other parts of
    a vLLM config in ``config``) current, and their bytes."""
    read: dict[str, int] = {}

    class Spy:
        def __init__(self, *args, **kwargs):
            self._file = safe_open(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._file.keys()

        def get_tensor(self, name):
            tensor = self._file.get_tensor(name)
            read[name] = tensor.numel() * tensor.element_size()
            return tensor

    monkeypatch.setattr(weight_utils, "safe_open", Spy)
    with set_current_vllm_config(SimpleNamespace(afd_config=afd, **config)):
        yielded = [n for n, _ in weight_utils.safetensors_weights_iterator(files, False)]
    assert sorted(yielded) == sorted(read)
    return read


def ffn_role_owns(name: str, gate_on_attention: bool) -> bool:
    if gate_on_attention and name.endswith(".mlp.gate.weight"):
        return False
    return ".mlp." in name


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
def test_each_role_reads_only_its_tensors(
    qwen3_moe_checkpoint, tmp_path, monkeypatch, gate_on_attention
):
    files = sharded_copy(qwen3_moe_checkpoint, tmp_path / "sharded")
    everything = read_by_role(files, None, monkeypatch)
    roles = {
        role: read_by_role(
            files, AFDConfig(role=role, compute_gate_on_attention=gate_on_attention), monkeypatch
        )
        for role in ("attention", "ffn")
    }
    for role, read in roles.items():
        total = sum(read.values())
        print(f"{role} role reads {len(read)} tensors, {total} bytes of {sum(everything.values())}")
    ffn = {n for n in everything if ffn_role_owns(n, gate_on_attention)}
    assert set(roles["ffn"]) == ffn
    assert set(roles["attention"]) == set(everything) - ffn
    assert any(".experts." in n for n in ffn)
    assert any(".self_attn." in n for n in roles["attention"])
    assert ("model.layers.0.mlp.gate.weight" in roles["attention"]) == gate_on_attention
    # Every tensor is read by exactly one role, once: the files hold no other bytes.
    assert sum(roles["attention"].values()) + sum(roles["ffn"].values()) == sum(everything.values())
    # An FP8 weight's block scales go with it.
    for read in roles.values():
        scales = [n for n in read if n.endswith("_scale_inv")]
        assert all(n.removesuffix("_scale_inv") in read for n in scales), scales
    if "fp8" in qwen3_moe_checkpoint.name:
        assert any(n.endswith(".experts.0.down_proj.weight_scale_inv") for n in roles["ffn"])
        assert any(n.endswith(".self_attn.o_proj.weight_scale_inv") for n in roles["attention"])


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_neither_role_reads_a_multi_token_prediction_layers_ffn(
    arch, request, tmp_path, monkeypatch
):
    """A checkpoint's MTP layer (layer 2 of these, after the 2 decoder layers)
    is not part of the model AFD serves: the FFN role reads none of it, the
    attention role what stock vLLM's loader reads of it and skips (not its
    experts)."""
    from vllm.config import ModelConfig

    model = request.getfixturevalue(f"tiny_{arch}")
    files = sharded_copy(model, tmp_path / "sharded")
    everything = read_by_role(files, None, monkeypatch)
    model_config = ModelConfig(str(model))
    roles = {
        role: read_by_role(files, AFDConfig(role=role), monkeypatch, model_config=model_config)
        for role in ("attention", "ffn")
    }
    mtp = {n for n in everything if n.startswith("model.layers.2.")}
    assert any(".experts." in n for n in mtp) and any(".eh_proj." in n for n in mtp)
    assert set(roles["ffn"]) == {n for n in everything if ffn_role_owns(n, False)} - mtp
    assert set(roles["attention"]) == {n for n in everything if not ffn_role_owns(n, False)}


@pytest.mark.parametrize("gate_on_attention", [False, True], ids=["gate-ffn", "gate-attn"])
def test_a_vision_language_models_ffn_role_reads_only_its_decoder_layers_ffns(
    tiny_qwen3_5_moe, tmp_path, monkeypatch, gate_on_attention
):
    """Qwen3.5-MoE's decoder layers are under ``model.language_model.``: the
    FFN role reads their FFNs (the routed experts as two 3-D tensors a
    layer) and nothing of the vision tower, whose blocks have MLPs of their
    own, or of the multi-token-prediction layer (``mtp.*``); the attention
    role reads all the rest."""
    from vllm.config import ModelConfig

    files = sharded_copy(tiny_qwen3_5_moe, tmp_path / "sharded")
    everything = read_by_role(files, None, monkeypatch)
    model_config = ModelConfig(str(tiny_qwen3_5_moe))
    roles = {
        role: read_by_role(
            files,
            AFDConfig(role=role, compute_gate_on_attention=gate_on_attention),
            monkeypatch,
            model_config=model_config,
        )
        for role in ("attention", "ffn")
    }
    layers = tuple(f"model.language_model.layers.{i}.mlp." for i in range(2))
    gate = tuple(f"{layer}gate.weight" for layer in layers) if gate_on_attention else ()
    ffn = {n for n in everything if n.startswith(layers) and not n.endswith(gate)}
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in ffn
    assert set(roles["ffn"]) == ffn
    assert set(roles["attention"]) == set(everything) - ffn
    assert any(n.startswith("model.visual.blocks.0.mlp.") for n in roles["attention"])
    assert any(n.startswith("mtp.layers.0.mlp.experts.") for n in roles["attention"])


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_each_expert_parallel_ffn_process_reads_only_its_experts(
    qwen3_moe_checkpoint, tmp_path, monkeypatch, placement
):
    """FFN group of two with expert parallelism: each process reads the
    experts vLLM's FusedMoE places on it, and the group's shared tensors.
    The process's rank in its group is what the loader would ask vLLM's
    tensor-parallel group for (not started in this unit test)."""
    import vllm.distributed
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    files = sharded_copy(qwen3_moe_checkpoint, tmp_path / "sharded")
    everything = read_by_role(files, None, monkeypatch)
    model_config = ModelConfig(str(qwen3_moe_checkpoint))
    num_experts = model_config.get_num_experts()
    afd = AFDConfig(role="ffn", ffn_tensor_parallel_size=2, ffn_enable_expert_parallel=True)
    parallel = ParallelConfig(enable_expert_parallel=True, expert_placement_strategy=placement)
    reads = []
    for rank in range(2):
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda r=rank: r)
        reads.append(
            read_by_role(
                files, afd, monkeypatch, model_config=model_config, parallel_config=parallel
            )
        )
        print(f"FFN group rank {rank} ({placement}) reads {sum(reads[-1].values())} bytes")
    ffn = {n for n in everything if ffn_role_owns(n, False)}
    experts = {n for n in ffn if ".experts." in n}
    assert experts and reads[0].keys() & reads[1].keys() == ffn - experts
    assert reads[0].keys() | reads[1].keys() == ffn
    for rank, read in enumerate(reads):
        _, expert_map, _ = determine_expert_map(2, rank, num_experts, placement)
        placed = {e for e in range(num_experts) if expert_map[e] >= 0}
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in read if n in experts} == placed


@pytest.mark.parametrize(
    ("name", "ffn"),
    [
        ("model.layers.3.mlp.gate_proj.weight_scale_inv", True),
        ("model.layers.3.mlp.down_proj.weight_scale_inv", True),
        ("model.layers.3.mlp.experts.17.up_proj.weight_scale_inv", True),
        ("model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv", True),
        ("model.layers.3.mlp.shared_expert.gate_proj.weight_scale_inv", True),
        ("model.layers.3.mlp.gate.e_score_correction_bias", True),
        ("model.layers.3.self_attn.o_proj.weight_scale_inv", False),
        ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv", False),
        ("model.layers.3.self_attn.q_b_proj.weight_scale_inv", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
    ],
)
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_fp8_block_scales_go_with_their_weights(name, ffn, gate_on_attention):
    """DeepSeek-V3's FP8 checkpoints: ``<weight>_scale_inv`` belongs to the
    role of its weight; the router gate is never quantized, its correction
    bias stays with the experts in both gate placements."""
    assert is_ffn_weight(name, gate_on_attention) == ffn
    weight = name.removesuffix("_scale_inv")
    if weight != name:
        assert is_ffn_weight(weight, gate_on_attention) == ffn
    assert is_ffn_weight("model.layers.3.mlp.gate.weight", gate_on_attention) != gate_on_attention


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_gpt_oss_router_and_its_bias_go_with_the_gate(gate_on_attention):
    """gpt-oss's router (``mlp.router``, with a bias that is part of its
    logits) goes where the gate runs; its expert tensors and their biases
    stay on the FFN side."""
    for tensor in ("weight", "bias"):
        router = f"model.layers.5.mlp.router.{tensor}"
        assert is_ffn_weight(router, gate_on_attention) != gate_on_attention
    for expert in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert is_ffn_weight(f"model.layers.5.mlp.experts.{expert}", gate_on_attention)
    assert not is_ffn_weight("model.layers.5.self_attn.sinks", gate_on_attention)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_minimax_m2_block_sparse_moe_is_the_ffn(gate_on_attention):
    """MiniMax-M2 names each layer's FFN ``block_sparse_moe``: its experts and
    the block's correction bias are the FFN side's, its gate goes where the
    gate runs."""
    block = "model.layers.5.block_sparse_moe"
    assert is_ffn_weight(f"{block}.experts.3.w1.weight", gate_on_attention)
    assert is_ffn_weight(f"{block}.e_score_correction_bias", gate_on_attention)
    assert is_ffn_weight(f"{block}.gate.weight", gate_on_attention) != gate_on_attention
    assert not is_ffn_weight("model.layers.5.self_attn.q_norm.weight", gate_on_attention)


@pytest.mark.parametrize("parent", ["", "language_model."])
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_minimax_m3_each_layers_ffn_under_its_own_name_is_the_ffn(
    gate_on_attention, parent, tiny_minimax_m3
):
    """MiniMax-M3 names a dense layer's FFN ``mlp`` and a MoE layer's
    ``block_sparse_moe`` (the spec's name per layer): every tensor under the
    layer's name is the FFN side's, the correction bias with the experts,
    the router gate where it runs; attention with its indexer, norms,
    embedding, head and the MTP layer (its FFN too: AFD runs no speculative
    decoding) are the attention side's, in the text checkpoint and under the
    vision-language model's ``language_model.``."""
    from vllm.afd.models.registry import get_afd_model_spec
    from vllm.transformers_utils.config import get_config

    config = get_config(str(tiny_minimax_m3), trust_remote_code=False).get_text_config()
    spec = get_afd_model_spec("MiniMaxM3SparseForCausalLM")
    ffns = tuple(
        f"model.layers.{i}.{spec.layer_ffn_name(config, i)}."
        for i in range(config.num_hidden_layers)
    )
    names = list(load_file(tiny_minimax_m3 / "model.safetensors"))
    gates = {n for n in names if n.endswith("block_sparse_moe.gate.weight") and "mtp" not in n}
    assert len(gates) == 2 and "model.layers.0.mlp.down_proj.weight" in names
    for name in names:
        ffn_side = name.startswith(ffns) and not (gate_on_attention and name in gates)
        assert is_ffn_weight(parent + name, gate_on_attention) == ffn_side, name
    for other in ("vision_tower.blocks.0.mlp.fc1.weight", "patch_merge_mlp.0.weight"):
        assert not is_ffn_weight(other, gate_on_attention)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_kimi_k25_language_model_ffns_are_the_ffn_sides(gate_on_attention):
    """Kimi-K2.5's checkpoints hold the language model under
    ``language_model.``, its decoder layers under ``language_model.model.``:
    their FFNs are the FFN side's (the gate where it runs, the correction
    bias with the experts); the MoonViT tower's MLPs, the projector, the
    embedding and the head are the attention side's."""
    layer = "language_model.model.layers.1.mlp"
    assert is_ffn_weight(f"{layer}.experts.7.down_proj.weight", gate_on_attention)
    assert is_ffn_weight(f"{layer}.shared_experts.gate_proj.weight", gate_on_attention)
    assert is_ffn_weight(f"{layer}.gate.e_score_correction_bias", gate_on_attention)
    assert is_ffn_weight(f"{layer}.gate.weight", gate_on_attention) != gate_on_attention
    assert is_ffn_weight("language_model.model.layers.0.mlp.down_proj.weight", gate_on_attention)
    for other in (
        "language_model.model.layers.1.self_attn.kv_b_proj.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "vision_tower.encoder.blocks.0.mlp.fc0.weight",
        "mm_projector.proj.0.weight",
    ):
        assert not is_ffn_weight(other, gate_on_attention), other


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_longcat_flash_mlps_and_shortcut_moe_are_the_ffn_sides(gate_on_attention):
    """LongCat-Flash's layer has two dense MLPs (``mlps.0``, ``mlps.1``) and a
    MoE block on its shortcut (``mlp``, router included): all the FFN side's;
    its two attentions and four norms the attention side's."""
    layer = "model.layers.1"
    for name in ("mlps.0.gate_proj.weight", "mlps.1.down_proj.weight",
                 "mlp.experts.7.up_proj.weight", "mlp.router.classifier.weight",
                 "mlp.router.e_score_correction_bias"):  # fmt: skip
        assert is_ffn_weight(f"{layer}.{name}", gate_on_attention), name
    for name in ("self_attn.1.kv_b_proj.weight", "post_attention_layernorm.1.weight"):
        assert not is_ffn_weight(f"{layer}.{name}", gate_on_attention), name
    # its multi-token-prediction layer, stored apart: the attention side's
    # loader reads and skips it, as stock vLLM's main model does
    assert not is_ffn_weight("model.mtp.layers.0.transformer_layer.mlp.up_proj.weight", False)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_deepseek_v4_ffns_in_its_own_names_are_the_ffn_sides(gate_on_attention):
    """DeepSeek-V4's checkpoints name a layer ``layers.N`` (no parent) and its
    MoE block ``ffn``: its experts, shared experts, correction bias
    (``ffn.gate.bias``) and token-id table (``ffn.gate.tid2eid``) are the
    FFN side's, the gate's weight goes where the gate runs; attention,
    compressors, indexer, hyper-connection mixers, norms, embedding, head and
    the multi-token-prediction layer (``mtp.0.*``) are the attention side's."""
    for name in ("experts.15.w1.weight", "experts.0.w2.scale", "shared_experts.w3.weight",
                 "gate.bias", "gate.tid2eid"):  # fmt: skip
        assert is_ffn_weight(f"layers.2.ffn.{name}", gate_on_attention), name
    assert is_ffn_weight("layers.2.ffn.gate.weight", gate_on_attention) != gate_on_attention
    for other in (
        "layers.2.attn.wq_a.weight",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.2.hc_ffn_fn",
        "layers.2.ffn_norm.weight",
        "embed.weight",
        "head.weight",
        "mtp.0.ffn.experts.3.w1.weight",
    ):
        assert not is_ffn_weight(other, gate_on_attention), other
