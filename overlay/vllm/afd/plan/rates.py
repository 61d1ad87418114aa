# SPDX-License-Identifier: Apache-2.0
"""A GPU's effective rates: what each role's kernels reach of the
specification, and the fixed costs around them. Without a profile they are
roofline defaults derived from the GPU preset; ``vllm afd-plan
--calibrate`` fits them on the user's GPU and saves them as a profile."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm.afd.plan.hardware import GPUSpec

PROFILE_VERSION = 1

# The defaults' shares of the specification and fixed costs: this project's
# fit of the 48-layer Qwen3-30B-A3B role times on one H200
# (benchmarks/results/afd_one_gpu_overlap_qwen3-30b-a3b.json): the experts
# were read at 3.8 of 4.8 TB/s, the KV cache at the specification, and the
# fixed costs per layer are launch chains, which do not scale with the GPU.
WEIGHT_READ_SHARE = 0.8
KV_READ_SHARE = 1.0
FLOP_SHARE = 0.5


@dataclass(frozen=True)
class Rates:
    """Effective rates of one GPU; times in seconds."""

    weight_bytes_per_s: float
    """Weight reads (the GEMMs of decode read their weights once per pass)."""
    kv_bytes_per_s: float
    """KV cache and recurrent state reads of decode attention."""
    flops: float
    """FLOP/s of the GEMMs at the weights' dtype, per token."""
    attention_layer_s: float = 40e-6
    """Attention side, per layer and pass: the kernel chain's fixed cost."""
    attention_seq_layer_s: float = 0.2e-6
    """Attention side, per layer and sequence, beyond its FLOPs and reads."""
    ffn_layer_s: float = 10e-6
    """FFN side, per layer and pass: router, expert kernels' fixed cost."""
    tail_s: float = 0.15e-3
    """Per step outside the layer loop, beside the LM head's read: final
    norm, sampler."""
    host_seq_s: float = 25.8e-6
    """The engine's host time per sequence per step; a step is the longer
    of the GPU's work and this (vLLM schedules asynchronously)."""
    exchange_layer_s: float = 10e-6
    """AFD: one layer's round trip between the roles beyond the link's
    latency and bytes (signalling, the peer noticing)."""
    shared_gpu_exchange_layer_s: float = 24e-6
    """AFD with both roles on one GPU under MPS: one layer's round trip."""
    source: str = "roofline"
    """"roofline" (defaults from the GPU preset) or the calibration that fitted them."""

    @classmethod
    def roofline(cls, gpu: GPUSpec, dtype: str) -> Rates:
        return cls(
            weight_bytes_per_s=WEIGHT_READ_SHARE * gpu.hbm_bytes_per_s,
            kv_bytes_per_s=KV_READ_SHARE * gpu.hbm_bytes_per_s,
            flops=FLOP_SHARE * gpu.flops_for(dtype),
            source=f"roofline of {gpu.name}",
        )


@dataclass(frozen=True)
class Profile:
    """What ``--calibrate`` saves: the fitted rates and where they came from."""

    gpu: str
    """The device's name as CUDA reports it."""
    model: str
    """The model the roles ran."""
    rates: Rates
    points: list[dict] = field(default_factory=list)
    """Each measured point with its fitted value (``calibrate.FitRow``)."""
    version: int = PROFILE_VERSION

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"{path}: profile version {data.get('version')}, this planner "
                f"reads {PROFILE_VERSION}; calibrate again"
            )
        return cls(**{**data, "rates": Rates(**data["rates"])})
