# SPDX-License-Identifier: Apache-2.0
"""The ipc connector's memory: one attention rank's device buffer of slots
(``IpcBufferLayout``), its flags, the two transfer halves on them
(``IpcSlots``), how the buffer crosses processes (``export_cuda_tensor``,
``import_cuda_tensor``), and the host thread that releases a lost peer's
waits (``FlagReleaser``). ``ipc_connector`` says how the data plane uses them.
"""

from __future__ import annotations

import base64
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.afd_transfer.flag_kernels import flag_kernels
from vllm.distributed.afd_transfer.payload import MAX_STAGES
from vllm.distributed.afd_transfer.resume import (
    RELEASE,
    STEP_MASK,
    STEP_WORD_BUSY,
    raised,
    taken,
)
from vllm.distributed.afd_transfer.stream_flags import SharedFlags, wait_flag, write_flag

TO_FFN, TO_ATTENTION = 0, 1
_ALIGN = 256
SIGNALS = ("stream", "kernel")
"""How the transfers signal: stream memory operations on the host page, or
the flag kernels on device flags (``ipc_signal`` "auto" picks one)."""


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class IpcBufferLayout:
    """Where each slot sits in one attention rank's buffer; both roles
    compute the same layout from the same numbers."""

    rows: int
    """Tokens a slot holds: the attention rank's max_num_batched_tokens."""
    widths: tuple[int, int]
    """Columns of a row in each direction: (TO_FFN, TO_ATTENTION)."""
    dtype: torch.dtype
    num_stages: int = MAX_STAGES
    """Slots per direction: one per overlap stage (``exchange_slot``'s three
    by layer are the first three)."""

    def _slot_bytes(self, direction: int) -> int:
        return _round_up(self.rows * self.widths[direction] * self.dtype.itemsize)

    @property
    def _slots_bytes(self) -> int:
        return self.num_stages * (self._slot_bytes(TO_FFN) + self._slot_bytes(TO_ATTENTION))

    @property
    def num_bytes(self) -> int:
        return self._slots_bytes + _round_up(4 * self.num_control_words)

    def slot(self, buffer: torch.Tensor, direction: int, stage: int) -> torch.Tensor:
        start = stage * self._slot_bytes(direction)
        if direction == TO_ATTENTION:
            start += self.num_stages * self._slot_bytes(TO_FFN)
        width = self.widths[direction]
        size = self.rows * width * self.dtype.itemsize
        return buffer[start : start + size].view(self.dtype).view(self.rows, width)

    @property
    def num_flags(self) -> int:
        return 2 * self.num_stages

    @property
    def step_word(self) -> int:
        """Index of the host word after the flags: the step the attention
        rank's GPU is in (written with failover, ``IpcSlots.begin_step``)."""
        return self.num_flags

    @property
    def num_host_words(self) -> int:
        return self.num_flags + 1

    def flag_index(self, direction: int, stage: int) -> int:
        return direction * self.num_stages + stage

    @property
    def num_control_words(self) -> int:
        """The flag kernels' words after the slots: a device flag per
        (direction, stage), and the arrival counter of its sender's copy."""
        return 2 * self.num_flags

    def control(self, buffer: torch.Tensor) -> torch.Tensor:
        """The control words, int32: flags, then the senders' arrival
        counters, each in ``flag_index`` order."""
        start = self._slots_bytes
        return buffer[start : start + 4 * self.num_control_words].view(torch.int32)


_HANDLE_BYTES = ("handle", "ref_counter_handle", "event_handle")
_HANDLE_INTS = ("size_bytes", "offset_bytes", "ref_counter_offset", "numel", "tensor_offset")


def export_cuda_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC handle of 1-D uint8 ``tensor`` as plain JSON values (it
    travels in the hello; no pickle, so a peer's hello cannot run code)."""
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1
    (_, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = tensor.untyped_storage()._share_cuda_()  # fmt: skip
    handles = zip(_HANDLE_BYTES, (handle, ref_counter_handle, event_handle), strict=True)
    return {
        **{k: base64.b64encode(v or b"").decode() for k, v in handles},
        "size_bytes": size_bytes,
        "offset_bytes": offset_bytes,
        "ref_counter_offset": ref_counter_offset,
        "event_sync_required": bool(event_sync_required),
        "numel": tensor.numel(),
        "tensor_offset": tensor.storage_offset(),
    }


def import_cuda_tensor(exported: dict[str, Any], device: int) -> torch.Tensor:
    """The exported tensor, mapped into visible GPU ``device``'s context.

    The mapping must live in the context of the streams that use it: a
    stream memory operation on a pointer mapped into another GPU's context
    fails ("invalid argument"). CUDA maps memory of another GPU through peer
    access. Raises ``ValueError`` for a malformed handle."""
    try:
        raw = {k: base64.b64decode(exported[k], validate=True) for k in _HANDLE_BYTES}
        ints = {k: exported[k] for k in _HANDLE_INTS}
        sync = exported["event_sync_required"]
    except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
        raise ValueError(f"malformed ipc buffer handle ({type(e).__name__}: {e})") from e
    if not all(type(v) is int and v >= 0 for v in ints.values()) or type(sync) is not bool:
        raise ValueError("malformed ipc buffer handle: sizes must be non-negative integers")
    return rebuild_cuda_tensor(
        torch.Tensor, (ints["numel"],), (1,), ints["tensor_offset"], torch.UntypedStorage,
        torch.uint8, device, raw["handle"], ints["size_bytes"], ints["offset_bytes"], False,
        raw["ref_counter_handle"], ints["ref_counter_offset"], raw["event_handle"], sync,
    )  # fmt: skip


class IpcSlots:
    """The slots and flags of one attention rank, and the two transfer
    halves, signalling with ``signal`` (one of ``SIGNALS``)."""

    def __init__(
        self,
        layout: IpcBufferLayout,
        buffer: torch.Tensor,
        flags: SharedFlags,
        signal: str = "stream",
    ) -> None:
        assert signal in SIGNALS
        self.layout = layout
        self.buffer = buffer
        self.flags = flags
        self.signal = signal
        flags.map_to_gpu()
        keys = list(itertools.product((TO_FFN, TO_ATTENTION), range(layout.num_stages)))
        self._slots = {key: layout.slot(buffer, *key) for key in keys}
        self._host_flags = {key: flags.address(layout.flag_index(*key)) for key in keys}
        self._kernels = None
        if signal == "kernel":
            self._kernels = flag_kernels(buffer.device.index)
            self._control = layout.control(buffer)
            rows = self._control.view(2, layout.num_flags)  # see IpcBufferLayout.control
            self._device_flags, self._send_arrivals = (
                {key: row[layout.flag_index(*key)].data_ptr() for key in keys} for row in rows
            )

    def raise_flags(self, direction: int) -> None:
        """Every flag of one direction to ``RELEASE``, from the host, which
        ends every wait on them (with the flag kernels: their release words)."""
        start = self.layout.flag_index(direction, 0)
        self.flags.words[start : start + self.layout.num_stages] = RELEASE

    def lower_release_words(self, direction: int) -> None:
        """With the flag kernels: every release word of one direction back to
        0, before this rank waits on them again."""
        assert self._kernels is not None
        start = self.layout.flag_index(direction, 0)
        self.flags.words[start : start + self.layout.num_stages] = 0

    def send(self, direction: int, slot: int, data: torch.Tensor, layer: int = 0) -> None:
        """Copy ``data`` into the slot, then raise its flag for ``layer``
        (stream-ordered)."""
        key = direction, slot
        rows = self._slots[key][: data.shape[0]]
        if self._kernels is None:
            rows.copy_(data)
            write_flag(self._host_flags[key], raised(layer))
        else:
            data = data.to(rows.dtype).contiguous()
            self._kernels.copy_then_raise(
                data, rows, self._device_flags[key], self._send_arrivals[key], raised(layer)
            )

    def receive(self, direction: int, slot: int, num_tokens: int, layer: int = 0) -> torch.Tensor:
        """Wait until the slot's flag is raised for ``layer``, lower it, and
        return the slot's first ``num_tokens`` rows (valid until the
        receiver answers)."""
        key = direction, slot
        if num_tokens == 0:
            return self._slots[key][:0]
        if self._kernels is None:
            wait_flag(self._host_flags[key], raised(layer))
            write_flag(self._host_flags[key], taken(layer))
        else:
            self._kernels.wait_then_lower(
                self._device_flags[key], self._host_flags[key], raised(layer), taken(layer)
            )
        return self._slots[key][:num_tokens]

    def rows(self, direction: int, slot: int, num_tokens: int) -> torch.Tensor:
        """The slot's first ``num_tokens`` rows, without waiting: rows a lost
        FFN rank had taken, which its replacement reads again."""
        return self._slots[direction, slot][:num_tokens]

    def begin_step(self, step_id: int) -> None:
        """Attention side, with failover, as a forward starts (stream-ordered):
        zero the flags and write the step into the step word, which says
        "busy" meanwhile, so that ``exchange_words`` reads one step's flags."""
        step_word = self.flags.address(self.layout.step_word)
        write_flag(step_word, STEP_WORD_BUSY)
        if self._kernels is None:
            # Stream writes, one per flag: ordered with the waits and writes
            # of the forwards on this stream.
            for key in self._host_flags:
                write_flag(self._host_flags[key], 0)
        else:
            self._control[: self.layout.num_flags].zero_()
        write_flag(step_word, step_id & STEP_MASK)

    def exchange_words(self) -> tuple[int, list[int], list[int]] | None:
        """Attention side: the step word and the flags of every slot each way
        (``resume.position_from_flags``, ``position_from_stage_flags``), read
        while the step word held one step; None while it says "busy"."""
        words = self.flags.words
        step = int(words[self.layout.step_word]) & 0xFFFFFFFF
        if step == STEP_WORD_BUSY:
            return None
        if self._kernels is None:
            flags = words[: self.layout.num_flags].clone()
        else:
            # Beside this rank's stream, which a spinning wait may hold.
            with torch.cuda.device(self.buffer.device), torch.cuda.stream(torch.cuda.Stream()):
                flags = self._control[: self.layout.num_flags].cpu()
        if int(words[self.layout.step_word]) & 0xFFFFFFFF != step:
            return None
        by_slot = [
            [
                int(flags[self.layout.flag_index(direction, slot)]) & 0xFFFFFFFF
                for slot in range(self.layout.num_stages)
            ]
            for direction in (TO_FFN, TO_ATTENTION)
        ]
        return step, by_slot[TO_FFN], by_slot[TO_ATTENTION]


class FlagReleaser:
    """Keeps raising one direction's flags of ``slots`` from the host until
    ``stop``, so that work queued behind waits on them drains (on garbage
    rows: the step is being discarded) and the host's wait returns."""

    def __init__(self, slots: list[IpcSlots], direction: int) -> None:
        self._slots = slots
        self._direction = direction
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-release", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for slots in self._slots:
                slots.raise_flags(self._direction)
            if self._stopped.wait(0.0005):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
