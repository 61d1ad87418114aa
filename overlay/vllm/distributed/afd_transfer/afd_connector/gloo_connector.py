# SPDX-License-Identifier: Apache-2.0
"""The ``gloo`` connector: CPU tensors over torch.distributed gloo point-to-point.

Why gloo rather than shared memory: it works between hosts as well as on
one, its transfers are bounded (``transfer_timeout_s`` in real steps), and a peer
that dies closes its TCP connection, which fails the pending transfer at once
("Connection closed by peer") instead of leaving a reader spinning on a
shared-memory flag. On one host the extra copy through loopback TCP costs
microseconds per layer at the sizes a CPU model runs.

Each FFN rank forms its own group with its peers (FFN rank = group rank 0,
peer p = group rank p + 1) through its store (``StoreGroupDataPlane``); the
gloo device is bound to the configured host too.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import torch
from torch.distributed import ProcessGroupGloo
from vllm.distributed.afd_transfer.afd_connector.rendezvous_store import StoreGroupDataPlane
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import MAX_STAGES

WHILE_THE_PEER_LIVES = timedelta(days=365)
"""The bound of a transfer before serving: none that a start-up reaches."""


def _tag(layer: int, stage: int) -> int:
    return layer * MAX_STAGES + stage  # one tag per stage of each layer


class GlooDataPlane(StoreGroupDataPlane):
    def __init__(self, spec, exchange) -> None:
        super().__init__(spec, exchange)
        self._group: ProcessGroupGloo | None = None

    def _join_group(self, store) -> None:
        options = ProcessGroupGloo._Options()
        # gloo listens for its pairs on this address: each rank's own
        options._devices = [ProcessGroupGloo.create_device(hostname=self.exchange.local_address)]
        # The group's timeout bounds its assembly; each transfer then waits
        # for its own bound (_bound), which overrides the group's.
        options._timeout = timedelta(seconds=self.spec.afd_config.startup_timeout_s)
        with self._guard("joining the gloo group"):
            self._group = ProcessGroupGloo(
                store, self.spec.group_rank, self.spec.group_size, options
            )

    def _bound(self) -> timedelta:
        # A gloo wait that times out closes its pair, so an unbounded wait
        # cannot be made of short ones; the peer's death fails it instead.
        if self.exchange.transfer_timeout_s is None:
            return WHILE_THE_PEER_LIVES
        return timedelta(seconds=self.exchange.transfer_timeout_s)

    @contextmanager
    def _guard(self, what: str):
        try:
            yield
        except RuntimeError as e:
            gloo = str(e).splitlines()[0]
            spec, timeout_s = self.spec, self.exchange.transfer_timeout_s
            if spec.role == "attention":
                wait_s = min(5.0, spec.afd_config.timeout_s)
                lost = self.exchange.describe_lost_ffn_rank(wait_s)
                raise AFDConnectionError(f"{lost}, while {what} (gloo: {gloo})") from e
            stalled = "" if timeout_s is None else f" or stalled for over {timeout_s:.0f} s"
            raise AFDConnectionError(
                f"AFD ffn rank {spec.rank}: lost attention ranks {list(spec.peer_ranks)} while "
                f"{what} "
                f"(gloo: {gloo}). A peer process has exited, crashed{stalled}; see its log."
            ) from e

    # attention side
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        if hidden_states.shape[0] == 0:
            return
        with self._guard(f"sending layer {layer} stage {stage}"):
            self._group.send([hidden_states.contiguous()], 0, _tag(layer, stage)).wait(
                self._bound()
            )

    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        if out.shape[0] == 0:
            return
        with self._guard(f"waiting for the FFN output of layer {layer} stage {stage}"):
            self._group.recv([out], 0, _tag(layer, stage)).wait(self._bound())

    # FFN side
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        buffers = [
            torch.empty((n, self.spec.input_width), dtype=self.spec.dtype) for n in token_counts
        ]
        with self._guard(f"receiving layer {layer} stage {stage}"):
            works = [
                self._group.recv([buf], 1 + peer, _tag(layer, stage))
                for peer, buf in enumerate(buffers)
                if buf.shape[0]
            ]
            for work in works:
                work.wait(self._bound())
        return buffers

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        with self._guard(f"sending the FFN output of layer {layer} stage {stage}"):
            works = [
                self._group.send([out.contiguous()], 1 + peer, _tag(layer, stage))
                for peer, out in enumerate(outputs)
                if out.shape[0]
            ]
            for work in works:
                work.wait(self._bound())

    def close(self) -> None:
        self._group = None
        super().close()
