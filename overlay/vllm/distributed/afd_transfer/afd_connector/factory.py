# SPDX-License-Identifier: Apache-2.0
"""Connector registry: names map to ``module:class`` paths, imported on first
use, so a CPU process never imports the CUDA connectors. The one list of
connector names: ``AFDConfig`` checks ``connector`` against it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase


class AFDConnectorFactory:
    _registry: dict[str, Callable[[], type[AFDConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"AFD connector {name!r} is already registered")

        def loader() -> type[AFDConnectorBase]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def create_connector(
        cls, vllm_config: VllmConfig, rank: int, input_width: int
    ) -> AFDConnectorBase:
        """``input_width``: columns of the rows sent to the FFN rank."""
        afd = vllm_config.afd_config
        assert afd is not None
        if afd.connector not in cls._registry:
            raise ValueError(
                f"AFD connector {afd.connector!r} is not available in this build; "
                f"available: {cls.names()}"
            )
        return cls._registry[afd.connector]()(vllm_config, rank, input_width)


for _name, _class in [
    ("gloo", "GlooAFDConnector"),
    ("ipc", "IpcAFDConnector"),
    ("nccl", "NcclAFDConnector"),
]:
    AFDConnectorFactory.register_connector(
        _name, f"vllm.distributed.afd_transfer.afd_connector.{_name}_connector", _class
    )
