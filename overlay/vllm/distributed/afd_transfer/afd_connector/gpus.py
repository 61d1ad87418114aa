# SPDX-License-Identifier: Apache-2.0
"""Which GPU this process runs on, which GPUs it can reach, by UUID, and
whether it runs there under MPS.

Device indices differ between processes (``CUDA_VISIBLE_DEVICES``, vLLM's
per-rank device choice); UUIDs name the same GPU in every process, so the
roles compare those.
"""

from __future__ import annotations

import torch


def device_uuid(index: int | None = None) -> str:
    """The UUID of visible GPU ``index`` (default: the current one)."""
    if index is None:
        index = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def reach_facts() -> dict[str, object]:
    """This process's GPU, every GPU it sees, and those it can map memory of
    (itself, and the ones with peer access from it)."""
    current = torch.cuda.current_device()
    visible = range(torch.cuda.device_count())
    reaches = [i for i in visible if i == current or torch.cuda.can_device_access_peer(current, i)]
    return {
        "gpu": device_uuid(current),
        "visible": [device_uuid(i) for i in visible],
        "reaches": [device_uuid(i) for i in reaches],
    }


def is_mps_client(device_index: int = 0) -> bool | None:
    """Whether this process's contexts on visible GPU ``device_index`` run
    under MPS, as the CUDA driver says; None where it cannot say."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    attribute = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_MPS_ENABLED", None)
    if attribute is None:
        return None
    (result,) = driver.cuInit(0)
    if result != driver.CUresult.CUDA_SUCCESS:
        return None
    result, device = driver.cuDeviceGet(device_index)
    if result != driver.CUresult.CUDA_SUCCESS:
        return None
    result, enabled = driver.cuDeviceGetAttribute(attribute, device)
    return bool(enabled) if result == driver.CUresult.CUDA_SUCCESS else None
