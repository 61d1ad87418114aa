# SPDX-License-Identifier: Apache-2.0
"""The ``ipc`` connector: CUDA IPC buffers with stream-operated flags.

The FFN rank allocates one device buffer holding, for every peer and stage, a
slot of hidden states each way and a flag each way, and shares it with its
peers through CUDA IPC. A transfer is a copy into the slot followed by
``cuStreamWriteValue32(flag, 1)``; the receiver's stream waits with
``cuStreamWaitValue32(flag == 1)``, resets the flag to 0 and reads the slot.
Everything is a stream operation, so CUDA graphs capture it and replay it,
and no host thread waits. It works for two processes on one GPU (where NCCL
refuses) and across the GPUs of one node that have peer access: an attention
rank on another GPU maps the FFN rank's buffer into its own GPU's context and
its stream writes and waits on it over NVLink. The handshake refuses a peer
whose GPU cannot map the FFN rank's (no peer access, or not visible to it).

One slot per direction is enough: the attention side writes layer L+1's
input only after it has waited for layer L's output, which the FFN side
sends only after it has consumed layer L's input.
"""

from __future__ import annotations

import base64
import itertools
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase
from vllm.distributed.afd_transfer.afd_connector.gpus import device_uuid, reach_facts
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import MAX_STAGES
from vllm.distributed.afd_transfer.stream_flags import wait_flag, write_flag

TO_FFN, TO_ATTENTION = 0, 1
_ALIGN = 256


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class IpcBufferLayout:
    """Where each slot and flag sits in the shared buffer; both roles compute
    the same layout from the same numbers."""

    num_peers: int
    rows: int
    """Tokens a slot holds: the FFN rank's max_num_batched_tokens."""
    widths: tuple[int, int]
    """Columns of a row in each direction: (TO_FFN, TO_ATTENTION)."""
    dtype: torch.dtype
    num_stages: int = MAX_STAGES
    """Slots per peer and direction: one per overlap stage."""

    def _slot_bytes(self, direction: int) -> int:
        return _round_up(self.rows * self.widths[direction] * self.dtype.itemsize)

    @property
    def _slots_per_direction(self) -> int:
        return self.num_peers * self.num_stages

    @property
    def _flags_start(self) -> int:
        both_slots = self._slot_bytes(TO_FFN) + self._slot_bytes(TO_ATTENTION)
        return self._slots_per_direction * both_slots

    @property
    def num_bytes(self) -> int:
        return self._flags_start + _round_up(4 * 2 * self._slots_per_direction)

    def _index(self, peer: int, stage: int) -> int:
        return peer * self.num_stages + stage

    def slot(self, buffer: torch.Tensor, direction: int, peer: int, stage: int) -> torch.Tensor:
        start = self._index(peer, stage) * self._slot_bytes(direction)
        if direction == TO_ATTENTION:
            start += self._slots_per_direction * self._slot_bytes(TO_FFN)
        width = self.widths[direction]
        size = self.rows * width * self.dtype.itemsize
        return buffer[start : start + size].view(self.dtype).view(self.rows, width)

    def flag(self, buffer: torch.Tensor, direction: int, peer: int, stage: int) -> torch.Tensor:
        index = direction * self._slots_per_direction + self._index(peer, stage)
        start = self._flags_start + 4 * index
        return buffer[start : start + 4].view(torch.int32)


def export_cuda_tensor(tensor: torch.Tensor) -> str:
    """A CUDA IPC handle of ``tensor`` as text (it travels in JSON)."""
    _, args = reduce_tensor(tensor)
    return base64.b64encode(pickle.dumps(args)).decode()


_STORAGE_DEVICE = 6  # position of the device index in reduce_tensor's arguments


def import_cuda_tensor(handle: str, device: int) -> torch.Tensor:
    """The exported tensor, mapped into visible GPU ``device``'s context.

    The handle carries the exporter's device index, which means nothing here
    (each process numbers its visible GPUs itself), and the mapping must live
    in the context of the streams that use it: a stream memory operation on
    a pointer mapped into another GPU's context fails ("invalid argument").
    CUDA maps memory of another GPU through peer access."""
    args = list(pickle.loads(base64.b64decode(handle)))
    args[_STORAGE_DEVICE] = device
    return rebuild_cuda_tensor(*args)


def unreachable_peers(ffn_gpu: str, peers: dict[int, dict[str, Any]]) -> list[str]:
    """Why attention ranks cannot map buffers on GPU ``ffn_gpu``, from their
    ``reach_facts`` by rank; empty if every one can."""
    problems = []
    for rank, facts in sorted(peers.items()):
        if ffn_gpu in facts["reaches"]:
            continue
        why = (
            "has no peer access to it"
            if ffn_gpu in facts["visible"]
            else "does not see it (CUDA_VISIBLE_DEVICES)"
        )
        problems.append(
            f"attention rank {rank} runs on GPU {facts['gpu']}, which {why}, so it cannot map "
            f"the FFN rank's ipc buffers on GPU {ffn_gpu}."
        )
    if problems:
        problems.append(
            "Use the nccl connector between GPUs without peer access, or put the roles on "
            "GPUs that have it (nvidia-smi topo -p2p r)."
        )
    return problems


class IpcSlots:
    """The slots and flags of one shared buffer, and the two transfer halves."""

    def __init__(self, layout: IpcBufferLayout, buffer: torch.Tensor) -> None:
        self.layout = layout
        self.buffer = buffer
        keys = itertools.product(
            (TO_FFN, TO_ATTENTION), range(layout.num_peers), range(layout.num_stages)
        )
        self._slots: dict[tuple[int, int, int], torch.Tensor] = {}
        self._flags: dict[tuple[int, int, int], torch.Tensor] = {}
        for key in keys:
            self._slots[key] = layout.slot(buffer, *key)
            self._flags[key] = layout.flag(buffer, *key)

    def flags(self, direction: int) -> list[torch.Tensor]:
        """Every flag of one direction (all peers and stages)."""
        return [flag for key, flag in self._flags.items() if key[0] == direction]

    def send(self, direction: int, peer: int, stage: int, data: torch.Tensor) -> None:
        """Copy ``data`` into the slot, then raise its flag (stream-ordered)."""
        self._slots[direction, peer, stage][: data.shape[0]].copy_(data)
        write_flag(self._flags[direction, peer, stage], 1)

    def receive(self, direction: int, peer: int, stage: int, num_tokens: int) -> torch.Tensor:
        """Wait for the slot's flag, lower it, and return the slot's first
        ``num_tokens`` rows (valid until the receiver answers)."""
        if num_tokens == 0:
            return self._slots[direction, peer, stage][:0]
        flag = self._flags[direction, peer, stage]
        wait_flag(flag, 1)
        write_flag(flag, 0)
        return self._slots[direction, peer, stage][:num_tokens]


class IpcAFDConnector(AFDConnectorBase):
    device_waits = True

    def __init__(self, vllm_config, rank: int, input_width: int) -> None:
        super().__init__(vllm_config, rank, input_width)
        self._rows = vllm_config.scheduler_config.max_num_batched_tokens
        self._buffer: torch.Tensor | None = None
        self._slots: IpcSlots | None = None

    def _layout(self, rows: int) -> IpcBufferLayout:
        widths = (self.input_width, self.output_width)
        return IpcBufferLayout(len(self.peer_ranks), rows, widths, self.dtype)

    def _device_facts(self) -> dict[str, Any]:
        return reach_facts()

    def _check_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        return unreachable_peers(device_uuid(), facts)

    def _serve_data_plane(self) -> dict[str, Any]:
        layout = self._layout(self._rows)
        self._buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()  # the zeroed flags must be in place before a peer looks
        return {"rows": self._rows, "buffer": export_cuda_tensor(self._buffer)}

    def _join_data_plane(self, data_plane: dict[str, Any]) -> None:
        rows = data_plane["rows"]
        if self.role == "attention":
            if self._rows > rows:
                raise AFDConnectionError(
                    f"AFD attention rank {self.rank}: the FFN rank's ipc buffers hold {rows} "
                    f"tokens per step, but this rank runs up to {self._rows} "
                    f"(max_num_batched_tokens); start the FFN rank with "
                    f"--max-num-batched-tokens {self._rows} or more"
                )
            self._buffer = import_cuda_tensor(data_plane["buffer"], torch.cuda.current_device())
        self._slots = IpcSlots(self._layout(rows), self._buffer)

    # attention side
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        if hidden_states.shape[0]:
            self._slots.send(TO_FFN, self.peer_index, stage, hidden_states)

    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        if out.shape[0]:
            out.copy_(self._slots.receive(TO_ATTENTION, self.peer_index, stage, out.shape[0]))

    # FFN side: the returned views stay valid until send_ffn_output, because
    # a peer writes its next input only after it has received this output.
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        return [self._slots.receive(TO_FFN, p, stage, n) for p, n in enumerate(token_counts)]

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        for peer, out in enumerate(outputs):
            if out.shape[0]:
                self._slots.send(TO_ATTENTION, peer, stage, out)

    def _abort_data_plane(self) -> None:
        """Keep raising the flags this rank waits on, from a stream of its
        own, so that the work queued behind them drains (on garbage rows:
        the step is being discarded) and the host's wait returns."""
        incoming = TO_ATTENTION if self.role == "attention" else TO_FFN
        flags = self._slots.flags(incoming)
        device = self._buffer.device

        def keep_releasing() -> None:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream()
            while True:
                with torch.cuda.stream(stream):
                    for flag in flags:
                        flag.fill_(1)
                time.sleep(0.001)

        threading.Thread(target=keep_releasing, name="afd-release", daemon=True).start()

    def _close_data_plane(self) -> None:
        self._slots = None
        self._buffer = None
