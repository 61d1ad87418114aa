# SPDX-License-Identifier: Apache-2.0
"""The ``nccl`` connector: NCCL point-to-point between the GPUs of the roles.

Each FFN rank forms its own group with its attention peers (one subgroup per
FFN rank; FFN rank = group rank 0, peer p = group rank p + 1) from a
``StatelessProcessGroup`` over the FFN rank's store, and talks through
vLLM's ``PyNcclCommunicator``. Its send and recv run on the current stream,
so CUDA graphs capture them. NCCL puts one rank per GPU: two roles on one GPU
use the ipc connector instead, and the group checks this before NCCL starts
(unless each process names an NCCL host of its own, ``NCCL_HOSTID``, a test
placement).
"""

from __future__ import annotations

import json
import os

import torch
from vllm.distributed.afd_transfer.afd_connector.gpus import device_uuid
from vllm.distributed.afd_transfer.afd_connector.rendezvous_store import StoreGroupDataPlane
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup


def duplicate_gpus(places: dict[int, tuple[str, str]]) -> list[list[int]]:
    """Group ranks that share a GPU as one NCCL host (each rank's place: its
    GPU's UUID and its ``NCCL_HOSTID``). NCCL runs one rank of a host per
    GPU; processes that each name a host of their own reach one another
    through NCCL's network transport, as if on other machines (a test
    placement)."""
    by_place: dict[tuple[str, str], list[int]] = {}
    for rank, place in sorted(places.items()):
        by_place.setdefault(tuple(place), []).append(rank)
    return [ranks for ranks in by_place.values() if len(ranks) > 1]


class NcclDataPlane(StoreGroupDataPlane):
    device_waits = True

    def __init__(self, spec, exchange) -> None:
        super().__init__(spec, exchange)
        self._comm: PyNcclCommunicator | None = None

    def _join_group(self, store) -> None:
        self._check_one_rank_per_gpu(store)
        spec = self.spec
        group = StatelessProcessGroup(rank=spec.group_rank, world_size=spec.group_size, store=store)
        self._comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def _check_one_rank_per_gpu(self, store) -> None:
        """Every rank publishes its GPU and reads the others' (bounded by the
        store's timeout), so all fail together, before NCCL would hang."""
        spec = self.spec
        place = (device_uuid(), os.environ.get("NCCL_HOSTID", ""))
        store.set(f"gpu/{spec.group_rank}", json.dumps(place))
        keys = [f"gpu/{r}" for r in range(spec.group_size)]
        try:
            store.wait(keys)
        except RuntimeError as e:
            raise AFDConnectionError(
                f"AFD {spec.role} rank {spec.rank}: the nccl group of FFN rank {spec.ffn_rank} "
                f"did not assemble within {spec.afd_config.startup_timeout_s:.0f} s ({e})"
            ) from e
        places = {r: json.loads(store.get(k)) for r, k in enumerate(keys)}
        shared = duplicate_gpus(places)
        if shared:
            names = {0: "FFN rank"} | {
                1 + p: f"attention rank {a}" for p, a in enumerate(spec.peer_ranks)
            }
            described = json.dumps([[names[r] for r in ranks] for ranks in shared])
            raise AFDConnectionError(
                f"AFD nccl connector: {described} share one GPU, and NCCL runs one rank per "
                "GPU. Give each rank its own GPU (CUDA_VISIBLE_DEVICES), or use the ipc "
                "connector for roles that share a GPU."
            )

    # attention side
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        if hidden_states.shape[0]:
            self._comm.send(hidden_states.contiguous(), dst=0)

    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        if out.shape[0]:
            self._comm.recv(out, src=0)

    # FFN side
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        buffers = [
            torch.empty((n, self.spec.input_width), dtype=self.spec.dtype, device="cuda")
            for n in token_counts
        ]
        self._comm.group_start()
        for peer, buf in enumerate(buffers):
            if buf.shape[0]:
                self._comm.recv(buf, src=1 + peer)
        self._comm.group_end()
        return buffers

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        self._comm.group_start()
        for peer, out in enumerate(outputs):
            if out.shape[0]:
                self._comm.send(out.contiguous(), dst=1 + peer)
        self._comm.group_end()

    def abort(self) -> None:
        """ncclCommAbort ends the NCCL kernels waiting on the lost peer."""
        if self._comm is not None:
            self._comm.destroy()

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
        self._comm = None
        super().close()
