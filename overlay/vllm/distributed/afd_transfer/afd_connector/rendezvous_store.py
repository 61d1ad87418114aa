# SPDX-License-Identifier: Apache-2.0
"""Connectors whose data plane is one process group per FFN rank (gloo,
nccl), formed through a TCP store that the FFN rank opens.

The FFN rank opens the store on the configured host only (a TCPStore left
to bind by itself listens on every interface) and hands its port to the
peers in the handshake reply, with the name under which the group's keys
live: only peers that proved the shared secret learn either. A peer reaches
the store on the host where it reached the FFN rank (``ffn_host``: `host`,
or after a failover one of `failover_hosts`).
"""

from __future__ import annotations

import secrets
import socket
from abc import abstractmethod
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store
from vllm.distributed.afd_transfer.afd_connector.base import AFDDataPlane
from vllm.distributed.utils import create_tcp_store


class StoreGroupDataPlane(AFDDataPlane):
    """Brings up the FFN rank's store; subclasses form their group on it."""

    _store: Store | None = None
    _store_port: int | None = None
    """FFN side: the port of the store it opened (``serve``)."""

    def serve(self) -> dict[str, Any]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((self.spec.host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        self._store_port = port
        self._store = create_tcp_store(
            self.spec.host,
            port,
            listen_socket=listener,
            world_size=self.spec.group_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.spec.afd_config.startup_timeout_s),
            use_libuv=False,
        )
        # The store itself takes anyone who reaches its port; the group's keys
        # live under a name that only authenticated peers learn (the welcome).
        prefix = f"afd/ffn{self.spec.ffn_rank}/{secrets.token_hex(16)}"
        return {"store_port": port, "store_prefix": prefix}

    def join(self, data_plane: dict[str, Any]) -> None:
        if self._store is None:  # an attention rank: the store is on the FFN rank's host
            self._store = create_tcp_store(
                data_plane["ffn_host"],
                data_plane["store_port"],
                world_size=self.spec.group_size,
                is_master=False,
                timeout=timedelta(seconds=self.spec.afd_config.startup_timeout_s),
                use_libuv=False,
            )
        self._join_group(PrefixStore(data_plane["store_prefix"], self._store))

    @abstractmethod
    def _join_group(self, store: Store) -> None:
        """Form this FFN rank's group (FFN rank = group rank 0, peer p = p + 1)
        on ``store``, a namespace of its own."""

    def close(self) -> None:
        self._store = None
