"""What the GPU connectors decide without a GPU: the ipc buffer layout, which
peers can map the ipc buffers, and the nccl one-rank-per-GPU check."""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm.distributed.afd_transfer.afd_connector.ipc_connector import (
    TO_ATTENTION,
    TO_FFN,
    IpcBufferLayout,
    unreachable_peers,
)
from vllm.distributed.afd_transfer.afd_connector.nccl_connector import duplicate_gpus


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_peers", [1, 3])
def test_ipc_slots_and_flags_are_disjoint_aligned_and_inside_the_buffer(dtype, num_peers):
    # rows to the FFN carry 8 router logits beside the hidden size of 70
    layout = IpcBufferLayout(num_peers=num_peers, rows=33, widths=(78, 70), dtype=dtype)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    keys = list(itertools.product((TO_FFN, TO_ATTENTION), range(num_peers), range(2)))
    spans = []
    for key in keys:
        slot, flag = layout.slot(buffer, *key), layout.flag(buffer, *key)
        assert slot.shape == (33, (78, 70)[key[0]]) and slot.dtype == dtype
        assert flag.shape == (1,) and flag.dtype == torch.int32
        for view in (slot, flag):
            start = view.data_ptr() - buffer.data_ptr()
            spans.append((start, start + view.numel() * view.element_size()))
        assert (slot.data_ptr() - buffer.data_ptr()) % 256 == 0
    spans.sort()
    assert spans[0][0] >= 0 and spans[-1][1] <= layout.num_bytes
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # writing one slot touches no other slot or flag
    layout.slot(buffer, TO_ATTENTION, num_peers - 1, 1).fill_(1)
    layout.flag(buffer, TO_FFN, 0, 0).fill_(7)
    assert int(buffer.sum()) == 7 + int(
        layout.slot(buffer, TO_ATTENTION, num_peers - 1, 1).view(torch.uint8).sum()
    )


def test_nccl_ranks_sharing_a_gpu_are_found():
    assert duplicate_gpus({0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}) == []
    assert duplicate_gpus({0: "GPU-a", 1: "GPU-a", 2: "GPU-b", 3: "GPU-b"}) == [[0, 1], [2, 3]]


def test_ipc_peers_must_reach_the_ffn_gpu():
    ffn = "GPU-a"
    same_gpu = {"gpu": "GPU-a", "visible": ["GPU-a"], "reaches": ["GPU-a"]}
    peer_access = {"gpu": "GPU-b", "visible": ["GPU-a", "GPU-b"], "reaches": ["GPU-b", "GPU-a"]}
    assert unreachable_peers(ffn, {0: same_gpu, 1: peer_access}) == []
    no_access = {"gpu": "GPU-c", "visible": ["GPU-a", "GPU-c"], "reaches": ["GPU-c"]}
    hidden = {"gpu": "GPU-d", "visible": ["GPU-d"], "reaches": ["GPU-d"]}
    problems = unreachable_peers(ffn, {3: hidden, 1: same_gpu, 2: no_access})
    assert problems == [
        "attention rank 2 runs on GPU GPU-c, which has no peer access to it, so it cannot map "
        "the FFN rank's ipc buffers on GPU GPU-a.",
        "attention rank 3 runs on GPU GPU-d, which does not see it (CUDA_VISIBLE_DEVICES), so "
        "it cannot map the FFN rank's ipc buffers on GPU GPU-a.",
        "Use the nccl connector between GPUs without peer access, or put the roles on GPUs "
        "that have it (nvidia-smi topo -p2p r).",
    ]
