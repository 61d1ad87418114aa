# SPDX-License-Identifier: Apache-2.0
"""Which checkpoint tensors each AFD role reads.

The FFN role needs every decoder layer's FFN (``model.layers.N.mlp.*``),
less the router gate when the gate runs on the attention side; the attention
role needs every other tensor. vLLM's safetensors iterators ask
``should_skip_weight`` about each tensor, by name, before reading it; with
patch 0018 that question also reaches ``skips_checkpoint_tensor``, so each
role leaves the other role's tensors on disk (in a MoE checkpoint the
experts are most of the bytes). Each role's model still passes over foreign
names itself, for loaders that read every tensor (``.bin`` files, dummy
weights, other formats).

With ``ffn_enable_expert_parallel`` each process of an FFN rank group also
leaves the other processes' experts unread: vLLM's loader would do that for
an expert-parallel deployment, but it finds the EP size in the parallel
config, where the FFN side keeps its group size in the AFD config instead.
"""

from __future__ import annotations

import functools
import re

from vllm.config.vllm import get_current_vllm_config_or_none

# A decoder layer's FFN: ``mlp`` in most models, MiniMax-M2's ``block_sparse_moe``,
# LongCat-Flash's ``mlp`` (its shortcut MoE) and ``mlps`` (its two dense MLPs),
# DeepSeek-V4's ``ffn``; a vision-language model's decoder layers are under
# ``model.language_model.`` (Qwen3.5's) or ``language_model.model.``
# (Kimi-K2.5's), and its vision tower's MLPs stay with the attention role;
# DeepSeek-V4's are under no parent (``layers.N``).
_LAYERS = r"^(?:model\.(?:language_model\.)?|language_model\.model\.)?layers\."
_FFN_WEIGHT = re.compile(_LAYERS + r"(\d+)\.(mlps?|block_sparse_moe|ffn)\.")
# A router gate's own tensors: ``gate`` in most models, gpt-oss's ``router``
# with its bias. A correction bias beside them (``gate.e_score_correction_bias``,
# DeepSeek-V4's ``ffn.gate.bias``) and DeepSeek-V4's token-id table
# (``ffn.gate.tid2eid``) serve the top-k choice, which stays with the experts.
_ROUTER_GATE_WEIGHT = re.compile(
    _LAYERS
    + r"\d+\.(?:(?:mlp|block_sparse_moe)\.(?:gate|router)\.(?:weight|bias)|ffn\.gate\.weight)$"
)


def is_ffn_weight(name: str, gate_on_attention: bool, num_layers: int | None = None) -> bool:
    """Whether checkpoint tensor ``name`` belongs to the FFN role; with
    ``num_layers``, only the FFNs of the decoder layers below it.

    A checkpoint's multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's:
    ``num_nextn_predict_layers`` of them, stored from ``num_hidden_layers``
    on) serve speculative decoding, which AFD does not run; stock vLLM's
    main model ignores them. So does AFD: the FFN role, given its model's
    ``num_layers``, neither reads nor builds them, and the attention role
    leaves their FFNs unread as it does every FFN. Qwen3.5's, stored apart
    (``mtp.*``), are not the FFN role's: the attention role reads them and
    its model skips them, as stock vLLM's does."""
    if gate_on_attention and _ROUTER_GATE_WEIGHT.match(name):
        return False
    match = _FFN_WEIGHT.match(name)
    return match is not None and (num_layers is None or int(match.group(1)) < num_layers)


def skips_checkpoint_tensor(name: str) -> bool:
    """Whether this process, as an AFD role, leaves checkpoint tensor
    ``name`` unread: it belongs to the other role, or to another process's
    experts. False without AFD (or outside model loading, where no vLLM
    config is current)."""
    vllm_config = get_current_vllm_config_or_none()
    afd = getattr(vllm_config, "afd_config", None)
    if afd is None:
        return False
    if afd.role != "ffn":
        return is_ffn_weight(name, afd.compute_gate_on_attention)
    model_config = getattr(vllm_config, "model_config", None)  # None in unit tests
    num_layers = model_config.get_total_num_hidden_layers() if model_config else None
    if not is_ffn_weight(name, afd.compute_gate_on_attention, num_layers):
        return True
    if not afd.ffn_enable_expert_parallel:
        return False
    # Imported here: ep_weight_filter imports this module (patch 0018).
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.ep_weight_filter import parse_expert_id

    expert = parse_expert_id(name)  # None for shared experts, gates, dense MLPs
    return expert is not None and expert not in group_expert_share(
        vllm_config.model_config.get_num_experts(),
        afd.ffn_tensor_parallel_size,
        get_tensor_model_parallel_rank(),
        vllm_config.parallel_config.expert_placement_strategy,
    )


@functools.cache
def group_expert_share(
    num_experts: int, group_size: int, group_rank: int, placement: str
) -> frozenset[int]:
    """The experts an FFN group process holds with expert parallelism: as
    vLLM's FusedMoE places them over an EP group of the FFN group's size."""
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

    share = compute_local_expert_ids(num_experts, group_size, group_rank, placement)
    assert share is not None, "expert parallelism needs a group of 2 or more"
    return frozenset(share)
