# SPDX-License-Identifier: Apache-2.0
"""The architectures AFD can split, and how the FFN side builds their FFNs.

The attention side needs nothing per architecture beyond the one-line hook
in the model file (see ``remote_ffn``). The FFN side builds each layer's FFN
with the same class and arguments as the upstream decoder layer, under the
same parameter names, so checkpoints load unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.quantization import QuantizationConfig
    from vllm.model_executor.models.utils import WeightsMapper


@dataclass(frozen=True)
class AFDModelSpec:
    """How one architecture's FFN is built on the FFN side."""

    build_ffn: Callable[[PretrainedConfig, QuantizationConfig | None, str], nn.Module]
    """Builds the FFN of one decoder layer from (text config, quant config,
    parameter prefix ``model.layers.N.mlp``)."""

    weights_mapper: Callable[[], WeightsMapper]
    """The upstream model's checkpoint-name mapper (stacked projections)."""


def _dense_mlp(module: str, class_name: str, **config_kwargs: str):
    """A builder for a gated MLP class that takes hidden size, intermediate
    size and activation; ``config_kwargs`` maps extra arguments to config
    attributes (False when absent)."""

    def build(config, quant_config, prefix: str) -> nn.Module:
        mlp_class = getattr(importlib.import_module(module), class_name)
        extra = {arg: getattr(config, attr, False) for arg, attr in config_kwargs.items()}
        return mlp_class(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=prefix,
            **extra,
        )

    return build


def _mapper_of(module: str, class_name: str):
    return lambda: getattr(importlib.import_module(module), class_name).hf_to_vllm_mapper


_MODELS = "vllm.model_executor.models"

SUPPORTED_ARCHITECTURES: dict[str, AFDModelSpec] = {
    "Qwen3ForCausalLM": AFDModelSpec(
        _dense_mlp(f"{_MODELS}.qwen2", "Qwen2MLP"),
        _mapper_of(f"{_MODELS}.qwen2", "Qwen2Model"),
    ),
    "LlamaForCausalLM": AFDModelSpec(
        _dense_mlp(f"{_MODELS}.llama", "LlamaMLP", bias="mlp_bias"),
        _mapper_of(f"{_MODELS}.llama", "LlamaModel"),
    ),
}


def get_afd_model_spec(architecture: str) -> AFDModelSpec:
    try:
        return SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"AFD does not support the architecture {architecture!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        ) from None


def afd_role_model_class(vllm_config: VllmConfig, model_class: type[nn.Module]) -> type[nn.Module]:
    """The class the model loader builds: the FFN-only model on the FFN role,
    the architecture's own class otherwise (the attention side's layers swap
    their FFN for ``RemoteFFN`` while they are built)."""
    afd = vllm_config.afd_config
    if afd is None or afd.role != "ffn":
        return model_class
    from vllm.afd.models.ffn_model import FFNModel

    return FFNModel
