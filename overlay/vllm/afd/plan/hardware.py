# SPDX-License-Identifier: Apache-2.0
"""GPU presets for the planner: the specifications that bound each role's
time (memory bandwidth, FLOP/s, memory) and the fabric between GPUs. Every
figure is the vendor's specification for one GPU; a flag overrides any."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One GPU and the fabric it sits on."""

    name: str
    """The preset's name."""
    hbm_bytes_per_s: float
    """Memory bandwidth."""
    flops: dict[str, float]
    """Dense tensor FLOP/s by weight dtype ("bf16", "fp8")."""
    memory_gib: float
    """Memory per GPU."""
    link_bytes_per_s: float
    """Scale-up fabric (NVLink, or PCIe) bandwidth per GPU, one direction."""
    link_latency_s: float
    """One transfer's latency on the scale-up fabric."""
    domain_gpus: int
    """GPUs that share the scale-up fabric (8 in an HGX node, 72 in an NVL72)."""
    scaleout_bytes_per_s: float
    """Bandwidth per GPU between scale-up domains (one NIC per GPU)."""
    scaleout_latency_s: float
    """One transfer's latency between scale-up domains."""
    host_sync_s: float = 50e-6
    """One hop of a small all-reduce between the hosts of data-parallel
    ranks (vLLM's per-step DP synchronisation runs on a CPU group)."""

    def flops_for(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["bf16"])

    def with_overrides(self, **values: float | None) -> GPUSpec:
        """This spec with each value that is not None replaced."""
        known = {f.name for f in fields(self)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown GPU fields {sorted(unknown)}")
        return replace(self, **{k: v for k, v in values.items() if v is not None})


NVLINK4, NVLINK5 = 450 * GB, 900 * GB
IB_400G, IB_800G = 50 * GB, 100 * GB


PRESETS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(
            "H100",
            3.35 * TB,
            {"bf16": 989e12, "fp8": 1979e12},
            80,
            NVLINK4,
            5e-6,
            8,
            IB_400G,
            15e-6,
        ),
        GPUSpec(
            "H200",
            4.8 * TB,
            {"bf16": 989e12, "fp8": 1979e12},
            141,
            NVLINK4,
            5e-6,
            8,
            IB_400G,
            15e-6,
        ),
        GPUSpec(
            "B200", 8 * TB, {"bf16": 2250e12, "fp8": 4500e12}, 180, NVLINK5, 5e-6, 8, IB_800G, 15e-6
        ),
        GPUSpec(
            "GB200",
            8 * TB,
            {"bf16": 2500e12, "fp8": 5000e12},
            186,
            NVLINK5,
            5e-6,
            72,
            IB_800G,
            15e-6,
        ),
        # Beyond the four of the issue: the GPUs of two published deployments.
        GPUSpec(
            "H20", 4.0 * TB, {"bf16": 148e12, "fp8": 296e12}, 96, NVLINK4, 5e-6, 8, IB_400G, 15e-6
        ),
        GPUSpec(
            "H100-PCIe",
            2.0 * TB,
            {"bf16": 756e12, "fp8": 1513e12},
            80,
            64 * GB,
            10e-6,
            8,
            IB_400G,
            15e-6,
        ),
    )
}
"""The presets by name."""
