"""What the GPU connectors decide without a GPU: the ipc buffer layout and
its shared flags page, which peers' ipc buffers the FFN rank can map, the
checks on what a peer's hello names, who may signal with the flag kernels,
the nccl one-rank-per-GPU check, and that the flag kernels compile (NVRTC
needs no GPU)."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm.afd.models.registry import ffn_exchange_shape
from vllm.distributed.afd_transfer import flag_kernels
from vllm.distributed.afd_transfer.afd_connector.base import DataPlaneSpec, StepExchange
from vllm.distributed.afd_transfer.afd_connector.ipc_connector import (
    IpcDataPlane,
    attention_signal_problem,
    chosen_signal,
    mapped_memory,
    parse_standby_offer,
    peer_signal_problem,
    unreachable_peers,
)
from vllm.distributed.afd_transfer.afd_connector.ipc_slots import (
    TO_ATTENTION,
    TO_FFN,
    IpcBufferLayout,
    import_cuda_tensor,
)
from vllm.distributed.afd_transfer.afd_connector.nccl_connector import duplicate_gpus
from vllm.distributed.afd_transfer.stream_flags import SharedFlags
from vllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_stages", [1, 3])
def test_ipc_slots_are_disjoint_aligned_and_inside_the_buffer(dtype, num_stages):
    # rows to the FFN carry 8 router logits beside the hidden size of 70
    layout = IpcBufferLayout(rows=33, widths=(78, 70), dtype=dtype, num_stages=num_stages)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    keys = list(itertools.product((TO_FFN, TO_ATTENTION), range(num_stages)))
    spans = []
    for key in keys:
        slot = layout.slot(buffer, *key)
        assert slot.shape == (33, (78, 70)[key[0]]) and slot.dtype == dtype
        start = slot.data_ptr() - buffer.data_ptr()
        spans.append((start, start + slot.numel() * slot.element_size()))
        assert start % 256 == 0
    control = layout.control(buffer)  # the flag kernels' flags and arrival counters
    assert control.dtype == torch.int32 and control.numel() == 2 * layout.num_flags
    start = control.data_ptr() - buffer.data_ptr()
    spans.append((start, start + 4 * control.numel()))
    assert start % 256 == 0
    spans.sort()
    assert spans[0][0] >= 0 and spans[-1][1] <= layout.num_bytes
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # every (direction, stage) has a flag of its own
    assert sorted(layout.flag_index(*key) for key in keys) == list(range(layout.num_flags))


def test_shared_flags_are_one_page_both_processes_see():
    """The attention rank creates the page, the FFN rank opens it by name;
    host stores on one side are what the other reads (the release after a
    lost peer), and the owner's close removes it."""
    owner = SharedFlags(6)
    peer = SharedFlags(6, owner.name)
    owner.words[3:6] = 1
    assert peer.words.tolist() == [0, 0, 0, 1, 1, 1]
    peer.words.zero_()
    assert owner.words.tolist() == [0] * 6
    path = Path("/dev/shm") / owner.name
    assert path.stat().st_mode & 0o777 == 0o600
    peer.close()
    assert path.exists()
    owner.close()
    assert not path.exists()


def test_a_killed_owners_flags_page_is_removed():
    """An attention rank killed with SIGKILL cannot remove its page; the
    resource tracker it registered the page with does, once it is gone."""
    owner = subprocess.Popen(
        [sys.executable, "-c", "from vllm.distributed.afd_transfer.stream_flags import SharedFlags;"
         "flags = SharedFlags(6); print(flags.name, flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        path = Path("/dev/shm") / owner.stdout.readline().strip()
        assert path.is_file(), "the page exists while its owner lives"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not path.exists(), f"{path} outlived its killed owner"
    finally:
        owner.kill()


@pytest.mark.parametrize("name", ["../etc/passwd", "afd-flags-xyz", "psm_1234", ""])
def test_a_peer_names_only_an_afd_flags_page(name):
    with pytest.raises(ValueError, match="not an AFD flags page name"):
        SharedFlags(6, name)


def handle_with(**changes) -> dict:
    """A handle of the exported form, with ``changes``."""
    handle = dict.fromkeys(("handle", "ref_counter_handle", "event_handle"), "AAAA")
    sizes = ("size_bytes", "offset_bytes", "ref_counter_offset", "numel", "tensor_offset")
    return {**handle, **dict.fromkeys(sizes, 1), "event_sync_required": False, **changes}


@pytest.mark.parametrize(
    "handle",
    [
        None,
        {},
        handle_with(handle="not base64!"),
        handle_with(size_bytes=-1),
        handle_with(numel="1"),
        handle_with(event_sync_required=0),
    ],
)
def test_a_malformed_ipc_handle_from_a_peer_is_refused_before_cuda_sees_it(handle):
    with pytest.raises(ValueError, match="malformed ipc buffer handle"):
        import_cuda_tensor(handle, 0)


def test_nccl_ranks_sharing_a_gpu_are_found():
    one_host = {0: ("GPU-a", ""), 1: ("GPU-a", ""), 2: ("GPU-b", ""), 3: ("GPU-b", "")}
    assert duplicate_gpus({0: ("GPU-a", ""), 1: ("GPU-b", ""), 2: ("GPU-c", "")}) == []
    assert duplicate_gpus(one_host) == [[0, 1], [2, 3]]
    # Processes that each name an NCCL host of their own may share a GPU.
    own_hosts = {0: ("GPU-a", "ffn"), 1: ("GPU-a", "attention"), 2: ("GPU-a", "attention")}
    assert duplicate_gpus(own_hosts) == [[1, 2]]


def test_the_ffn_rank_must_reach_every_peer_gpu():
    ffn = {"gpu": "GPU-a", "visible": ["GPU-a", "GPU-b", "GPU-c"], "reaches": ["GPU-a", "GPU-b"]}
    assert unreachable_peers(ffn, {0: "GPU-a", 1: "GPU-b"}) == []
    problems = unreachable_peers(ffn, {3: "GPU-d", 1: "GPU-a", 2: "GPU-c"})
    assert problems == [
        "attention rank 2 runs on GPU GPU-c, which the FFN rank's GPU GPU-a has no peer "
        "access to, so the FFN rank cannot map its ipc buffers.",
        "attention rank 3 runs on GPU GPU-d, which the FFN rank's GPU GPU-a does not see, so "
        "the FFN rank cannot map its ipc buffers.",
        "Use the nccl connector between GPUs without peer access, or put the roles on GPUs "
        "that have it (nvidia-smi topo -p2p r) and that the FFN rank sees "
        "(CUDA_VISIBLE_DEVICES).",
    ]


def test_auto_signals_with_the_flag_kernels_only_under_mps():
    assert chosen_signal("auto", mps_client=True) == "kernel"
    assert chosen_signal("auto", mps_client=False) == "stream"
    assert chosen_signal("auto", mps_client=None) == "stream"  # the driver cannot tell
    for configured in ("stream", "kernel"):
        assert chosen_signal(configured, mps_client=True) == configured


def test_only_an_mps_client_signals_with_the_flag_kernels():
    assert attention_signal_problem("stream", mps_client=False) is None
    assert attention_signal_problem("kernel", mps_client=True) is None
    for unknown_or_not in (False, None):
        problem = attention_signal_problem("kernel", mps_client=unknown_or_not)
        assert "needs MPS" in problem and '"mps": "start"' in problem
        assert 'ipc_signal "stream"' in problem
    assert "cannot tell" in attention_signal_problem("kernel", mps_client=None)


def test_the_ffn_rank_follows_the_signalling_of_its_peer_where_it_can():
    """An attention rank with the flag kernels runs under MPS; an FFN rank
    on its GPU outside that MPS daemon would take turns with the spin, so
    it refuses, with the fix; a peer that names an unknown way is refused
    too."""
    for shares_the_gpu, mps_client in itertools.product((False, True), (None, False, True)):
        assert peer_signal_problem(0, "stream", shares_the_gpu, mps_client) is None
        refused = shares_the_gpu and not mps_client
        assert (peer_signal_problem(0, "kernel", shares_the_gpu, mps_client) is None) != refused
    problem = peer_signal_problem(1, "kernel", shares_the_gpu=True, mps_client=False)
    assert "attention rank 1 runs under MPS" in problem and "CUDA_MPS_PIPE_DIRECTORY" in problem
    problem = peer_signal_problem(2, "smoke", shares_the_gpu=False, mps_client=True)
    assert problem.startswith("attention rank 2 signals ipc transfers with 'smoke'")
    assert peer_signal_problem(3, None, shares_the_gpu=False, mps_client=True) is not None


def ipc_ffn_data_plane(model, **afd) -> IpcDataPlane:
    config = EngineArgs(
        model=str(model), afd_config=dict(role="ffn", connector="ipc", **afd)
    ).create_engine_config()
    spec = DataPlaneSpec.of(config, 0, ffn_exchange_shape(config))
    return IpcDataPlane(spec, StepExchange())


def test_an_ffn_rank_joins_the_ipc_data_plane_without_flags_of_its_own(tiny_qwen3):
    """The attention side owns the buffer and flags; the FFN side only maps
    its peers'. A join, the first one or a replacement's, lowers the flags
    on the owner's side only: on the FFN side it once failed every ipc start."""
    data_plane = ipc_ffn_data_plane(tiny_qwen3)
    data_plane.join({})
    assert data_plane._slots is None and data_plane._peer_slots == []


def peer_facts(handle: str, event: str = "ZXZlbnQ=") -> dict:
    """An attention rank's hello facts for the ipc connector (no GPU needed
    to read them): its GPUs, its buffer's CUDA IPC handle, its flags page."""
    return {
        "gpu": "GPU-0", "visible": ["GPU-0"], "reaches": ["GPU-0"], "rows": 64,
        "flags": "afd-flags-1234", "signal": "stream",
        "buffer": {"handle": handle, "ref_counter_handle": "cmVm", "event_handle": event,
                   "size_bytes": 4096, "offset_bytes": 0, "ref_counter_offset": 0,
                   "event_sync_required": False, "numel": 4096, "tensor_offset": 0},
    }  # fmt: skip


def test_a_served_ipc_rank_offers_a_standby_its_peers_and_layouts_once_it_serves(tiny_qwen3):
    """What a standby maps and captures in advance comes from the served
    rank's offer: nothing while its captures may still come, then its
    peers' hello facts and its graphs' layouts, through JSON as the control
    plane carries them. An offer naming other peers, or malformed, is refused."""
    served = ipc_ffn_data_plane(tiny_qwen3, num_attention_ranks=2, standby=True)
    peers = {0: peer_facts("aGFuZGxlMA=="), 1: peer_facts("aGFuZGxlMQ==")}
    assert served.standby_offer(peers, None) is None
    layouts = [((4, 4),), ((1, 1), (2, 2))]
    offer = json.loads(json.dumps(served.standby_offer(peers, layouts)))
    assert parse_standby_offer(offer, [0, 1]) == (peers, layouts)
    with pytest.raises(ValueError, match=r"offers attention ranks \[0, 1\], not \[0\]"):
        parse_standby_offer(offer, [0])
    with pytest.raises(ValueError, match="malformed offer"):
        parse_standby_offer({**offer, "layouts": [["x"]]}, [0, 1])


def test_a_standby_keeps_the_memory_it_mapped_in_advance_and_refuses_other_memory(tiny_qwen3):
    """At its takeover, a standby that mapped its peers' memory in advance
    (and captured its graphs against it) keeps those mappings when the
    peers' hellos name the same memory, whatever else differs, and refuses
    peers whose buffers are others: a new deployment, not a failover."""
    standby = ipc_ffn_data_plane(tiny_qwen3, num_attention_ranks=2, standby=True)
    mapped = {0: peer_facts("aGFuZGxlMA=="), 1: peer_facts("aGFuZGxlMQ==")}
    standby._mapped_in_advance = {rank: mapped_memory(f) for rank, f in mapped.items()}
    kept = object()
    standby._peer_slots = [kept]
    same = {rank: {**f, "visible": ["GPU-0", "GPU-1"]} for rank, f in mapped.items()}
    same[1]["buffer"] = {**same[1]["buffer"], "event_handle": "b3RoZXI="}
    assert standby.check_peer_devices(same) == []
    assert standby._peer_slots == [kept]
    other = {**mapped, 1: peer_facts("bmV3IGhhbmRsZQ==")}
    [problem] = standby.check_peer_devices(other)
    assert "attention rank(s) [1] are not those whose buffers this standby mapped" in problem
    assert mapped_memory({**mapped[0], "flags": "afd-flags-99"}) != mapped_memory(mapped[0])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_flag_kernels_compile(arch):
    cubin = flag_kernels._compile(arch)
    assert cubin.startswith(b"\x7fELF")


def test_a_flag_kernel_that_does_not_compile_gives_the_compiler_log(monkeypatch):
    monkeypatch.setattr(flag_kernels, "_SOURCE", flag_kernels._SOURCE + "\nnot C++ at all;\n")
    with pytest.raises(RuntimeError, match=r"compiling the AFD flag kernels failed:\n.*error"):
        flag_kernels._compile("sm_90")
