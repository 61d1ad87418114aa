# SPDX-License-Identifier: Apache-2.0
"""LongCat-Flash's shortcut-connected MoE under AFD: both roles' parts.

A LongCat-Flash decoder layer runs two attentions, each followed by a dense
MLP (``mlps[0]``, ``mlps[1]``), and a MoE block (``mlp``) on a shortcut: the
block reads the first attention's normed output and its output joins the
second MLP's. Every FFN part goes to the FFN side, in two exchanges per
decoder layer, one after each attention:

- exchange ``2N`` sends the first attention's output ``h``; the FFN side runs
  the MoE block on ``h``, keeps its output, and returns ``mlps[0](h)``;
- exchange ``2N + 1`` sends the second attention's output ``h2``; the FFN side
  returns ``mlps[1](h2)`` plus the kept MoE output, the sum the layer ends with.

The exchanges of a forward are ``EXCHANGES_PER_LAYER`` times the config's
``num_layers`` (``registry.ffn_exchange_shape``); vLLM's own layer count
for the model differs between releases (0.26 counts its attentions).

This module holds the FFN side's layer; the attention side's stand-ins
(``remote_ffn.remote_shortcut_moe``) keep the upstream layer's forward: its
MLPs are remote exchanges, and its MoE block returns zeros, since the MoE
output arrives inside the second exchange's answer (``x + 0`` is exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import extract_layer_index

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.model_executor.models.utils import WeightsMapper

EXCHANGES_PER_LAYER = 2
"""Exchanges with the FFN side per decoder layer: one after each attention."""


def _flash_config(vllm_config: VllmConfig):
    """The config as the upstream model reads it: vLLM 0.26's own class
    (``FlashConfig``, built from transformers' config), from 0.32 on
    transformers' ``LongcatFlashConfig`` itself."""
    from vllm.model_executor.models import longcat_flash

    hf_config = vllm_config.model_config.hf_config
    flash_config = getattr(longcat_flash, "FlashConfig", None)
    return hf_config if flash_config is None else flash_config(**hf_config.__dict__)


class ShortcutMoELayer(nn.Module):
    """The FFN side of one LongCat-Flash decoder layer: its MoE block and its
    two MLPs, built as ``FlashDecoderLayer`` builds them, under its names."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        from vllm.model_executor.models.longcat_flash import FlashMLP, LongcatMoe

        config = _flash_config(vllm_config)
        quant_config = vllm_config.quant_config
        mlps_quant = None if "mlps" in getattr(config, "disable_quant_module", []) else quant_config
        self.mlps = nn.ModuleList(
            FlashMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=mlps_quant,
                prefix=f"{prefix}.mlps.{i}",
            )
            for i in range(EXCHANGES_PER_LAYER)
        )
        layer = extract_layer_index(prefix)
        self.mlp = LongcatMoe(
            config=config,
            num_experts=getattr(config, "n_routed_experts", None) or config.num_experts[layer],
            top_k=getattr(config, "moe_topk", None) or config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self._shortcut: dict[int, torch.Tensor] = {}
        """The MoE output of the first exchange, per micro-batch stage, until
        the second exchange of the layer adds it."""

    def forward(self, rows: torch.Tensor, part: int, stage: int) -> torch.Tensor:
        if part == 0:
            self._shortcut[stage] = self.mlp(rows.clone())  # the block reads a copy, as upstream
            return self.mlps[0](rows)
        return self.mlps[1](rows) + self._shortcut.pop(stage)


def shortcut_moe_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """``AFDModelSpec.build_ffn`` of LongCat-Flash, from the decoder layer's
    prefix ``model.layers.N``."""
    return ShortcutMoELayer(vllm_config, prefix)


def longcat_flash_mapper(config: PretrainedConfig) -> WeightsMapper:
    """LongCat-Flash's stacked MLP projections (the routed experts are loaded
    by FusedMoE itself, under their own names)."""
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper(
        orig_to_new_stacked={
            f".mlps.{i}.{name}": (f".mlps.{i}.gate_up_proj", shard)
            for i in range(EXCHANGES_PER_LAYER)
            for shard, name in enumerate(("gate_proj", "up_proj"))
        }
    )
