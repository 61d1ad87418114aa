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
"""

from __future__ import annotations

import re

from vllm.config.vllm import get_current_vllm_config_or_none

_FFN_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.")
_ROUTER_GATE_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")


def is_ffn_weight(name: str, gate_on_attention: bool) -> bool:
    """Whether checkpoint tensor ``name`` belongs to the FFN role."""
    if gate_on_attention and _ROUTER_GATE_WEIGHT.match(name):
        return False
    return _FFN_WEIGHT.match(name) is not None


def skips_checkpoint_tensor(name: str) -> bool:
    """Whether this process, as an AFD role, leaves checkpoint tensor
    ``name`` unread: it belongs to the other role. False without AFD (or
    outside model loading, where no vLLM config is current)."""
    vllm_config = get_current_vllm_config_or_none()
    afd = getattr(vllm_config, "afd_config", None)
    if afd is None:
        return False
    return is_ffn_weight(name, afd.compute_gate_on_attention) != (afd.role == "ffn")
