# SPDX-License-Identifier: Apache-2.0
"""What both role endpoints share: the data plane they own, the bound of each
transfer, the watchdog that notices a lost peer, and teardown."""

from __future__ import annotations

import atexit
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.distributed.afd_transfer.afd_connector.base import (
    DataPlaneSpec,
    ExchangeShape,
    StepExchange,
)
from vllm.distributed.afd_transfer.afd_connector.factory import AFDConnectorFactory
from vllm.distributed.afd_transfer.handshake import AFDFingerprint, AFDPeerLostError
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.watchdog import raise_in_thread
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.watchdog import (
        ControlConnectionWatchdog,
        PeerLossWatchdog,
    )

logger = init_logger(__name__)


class AFDEndpoint(ABC):
    """One rank's end of the AFD planes: a data plane and the control plane."""

    role: str
    """``"attention"`` or ``"ffn"``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int,
        shape: ExchangeShape,
        exchange: StepExchange,
        on_close: Iterable[Callable[[], None]] = (),
    ) -> None:
        self.spec = DataPlaneSpec.of(vllm_config, rank, shape)
        assert self.spec.role == self.role, f"a {self.role} endpoint on a {self.spec.role} rank"
        self.afd_config = self.spec.afd_config
        self.fingerprint = AFDFingerprint.from_vllm_config(vllm_config, shape.num_layers)
        self.port = self.afd_config.port + self.spec.ffn_rank
        self.on_gpu = vllm_config.device_config.device_type == "cuda"
        self.exchange = exchange
        self.data_plane = AFDConnectorFactory.create_data_plane(self.spec, exchange)
        self._on_close = list(on_close)
        """Run after the endpoint closes (e.g. reap a spawned FFN)."""
        self._next_step = 0
        self._closed = False
        self._watchdog: ControlConnectionWatchdog | PeerLossWatchdog | None = None
        self._model_thread = 0

    @property
    def rank(self) -> int:
        """Attention rank (role "attention") or FFN rank (role "ffn")."""
        return self.spec.rank

    @property
    def ffn_rank(self) -> int:
        return self.spec.ffn_rank

    @property
    def peer_ranks(self) -> list[int]:
        """The attention ranks served by ``ffn_rank``, in peer order."""
        return list(self.spec.peer_ranks)

    @property
    def host(self) -> str:
        return self.spec.host

    def _connected(self) -> None:
        """After the handshake and the data plane's join, in the worker
        thread that runs the model."""
        atexit.register(self.close)
        self._model_thread = threading.get_ident()
        self._watch()
        logger.info(
            "AFD %s rank %d connected over %s (FFN rank %d, attention peers %s)",
            self.role,
            self.rank,
            self.afd_config.connector,
            self.ffn_rank,
            self.peer_ranks,
        )

    @abstractmethod
    def _watch(self) -> None:
        """Watch the peers from a thread: a lost peer must end this rank even
        while it waits on that peer where no error reaches it."""

    def _bound_transfers(self, step: ControlPayload) -> None:
        # The forwards before serving (profiling, warm-ups, captures) may
        # wait for a peer that compiles its model inside them: only the peer's
        # death ends such a wait (its connections closing or, for a vanished
        # host, failing: see control.framing), not its duration.
        self.exchange.step_id = step.step_id
        self.exchange.stages = step.num_stages
        self.exchange.transfer_timeout_s = self.afd_config.timeout_s if step.is_real else None

    def _stop_model_thread(self) -> None:
        """Release this rank's device waits on the lost peer, raise in the
        thread that runs the model (vLLM then reports the engine dead), and
        exit if that has not ended the process within timeout_s."""
        if self.data_plane.device_waits:
            self.data_plane.abort()
        raise_in_thread(self._model_thread, AFDPeerLostError)
        time.sleep(self.afd_config.timeout_s)
        logger.error(
            "AFD %s rank %d: still running %.0f s after losing a peer; exiting",
            self.role,
            self.rank,
            self.afd_config.timeout_s,
        )
        os._exit(1)

    def close(self) -> None:
        """Release everything, once; the roles say goodbye first (``_say_goodbye``)."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self._say_goodbye()
        try:
            self.data_plane.close()
        finally:
            for callback in self._on_close:
                callback()

    @abstractmethod
    def _say_goodbye(self) -> None:
        """Close this role's end of the control plane."""
