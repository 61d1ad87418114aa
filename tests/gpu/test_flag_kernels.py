"""The ipc connector's flag kernels (``flag_kernels``) on one GPU, in one
process: the host stands in for the peer, raising and reading the flags,
which for that live in a page of shared host memory (words 0 and 1) beside
the release words (2 and 3).

- ``copy_then_raise`` copies the rows and raises the flag;
- ``wait_then_lower`` stays blocked while the flag is below the value it
  waits for, and goes on once the flag is raised (then lowers it to the
  value it is given), or once the host stores 1 in its release word (what a
  lost peer's release does; then the flag stays as it was, since "lowered"
  tells a replacement that the rows had arrived);
- captured in a CUDA graph, they replay as captured (the arrival counters
  return to 0), with a size that spans more blocks than the GPU has SMs.
"""

from __future__ import annotations

import time

import pytest
import torch


@pytest.fixture(scope="module")
def kernels():
    from vllm.distributed.afd_transfer.flag_kernels import FlagKernels

    return FlagKernels(torch.cuda.current_device())


@pytest.fixture
def flags():
    from vllm.distributed.afd_transfer.stream_flags import SharedFlags

    page = SharedFlags(4)
    page.map_to_gpu()
    yield page
    page.close()


def _arrivals() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device="cuda")


def _on_a_side_stream(launch) -> torch.cuda.Event:
    """Launch on a stream of its own; the event marks the launch's end."""
    stream, done = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        launch()
        done.record()
    return done


def _still_blocked(done: torch.cuda.Event, seconds: float = 0.2) -> bool:
    time.sleep(seconds)
    return not done.query()


def _ends_soon(done: torch.cuda.Event, flags, seconds: float = 10.0) -> bool:
    """Whether the launch ends within ``seconds``; if it does not, the host
    stores the release words, so that a failing test does not hang."""
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            flags.words[2:4] = 1
            done.synchronize()
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "4-byte-offset"])
@pytest.mark.parametrize("rows", [8, 20000])
def test_copy_then_raise_copies_then_raises(kernels, flags, rows, offset):
    """16-byte pieces where both ends are 16-byte aligned, words elsewhere."""
    size = rows * 1024 + 2  # an odd number of words
    src = torch.randn(size + offset, dtype=torch.bfloat16, device="cuda")[offset:]
    dst = torch.zeros(size + offset, dtype=torch.bfloat16, device="cuda")[offset:]
    arrivals = _arrivals()
    kernels.copy_then_raise(src, dst, flags.address(0), arrivals.data_ptr())
    torch.cuda.synchronize()
    assert flags.words[0].item() == 1
    assert torch.equal(dst, src)
    assert arrivals.item() == 0


RAISED, RELEASED = 0, 2
"""Which word the host raises to end a wait: the flag, or the release word."""


@pytest.mark.parametrize("end_by", [RAISED, RELEASED])
def test_wait_then_lower_waits_for_the_flag_or_the_release(kernels, flags, end_by):
    taken = -2  # resume.taken(1) as an int32: below every raised value
    flags.words[0] = taken
    done = _on_a_side_stream(
        lambda: kernels.wait_then_lower(flags.address(0), flags.address(2), 2, taken & 0xFFFFFFFF)
    )
    assert _still_blocked(done), "wait_then_lower ran past a lowered flag"
    flags.words[0] = 1
    assert _still_blocked(done), "wait_then_lower ran past a flag below the value it waits for"
    flags.words[end_by] = 2 if end_by == RAISED else 1
    assert _ends_soon(done, flags), "wait_then_lower did not end"
    # Raised: lowered to the value given. Released: left as it was.
    assert flags.words[0].item() == (taken if end_by == RAISED else 1)


def test_a_captured_round_trip_replays(kernels, flags):
    """Send, and receive what the peer sent, as the ipc connector does
    (the peer's slot is the same rows here), in one graph; the host raises
    the receive flag before each replay, as the peer would."""
    rows = 20000
    src = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    slot, dst = torch.zeros_like(src), torch.zeros_like(src)
    send_arrivals = _arrivals()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.copy_then_raise(src, slot, flags.address(0), send_arrivals.data_ptr())
        kernels.wait_then_lower(flags.address(1), flags.address(3))
        dst.copy_(slot)
    for _ in range(3):
        src.normal_()
        dst.zero_()
        flags.words[1] = 1
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
        assert flags.words.tolist() == [1, 0, 0, 0]
        flags.words[0] = 0
    assert send_arrivals.item() == 0
