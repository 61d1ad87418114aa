# SPDX-License-Identifier: Apache-2.0
"""Connector registry: names map to ``module:class`` paths of data planes,
imported on first use, so a CPU process never imports the CUDA connectors.
The one list of connector names: ``AFDConfig`` checks ``connector`` against it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.afd_connector.base import (
        AFDDataPlane,
        DataPlaneSpec,
        StepExchange,
    )


class AFDConnectorFactory:
    _registry: dict[str, Callable[[], type[AFDDataPlane]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"AFD connector {name!r} is already registered")

        def loader() -> type[AFDDataPlane]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def create_data_plane(cls, spec: DataPlaneSpec, exchange: StepExchange) -> AFDDataPlane:
        """The data plane of the connector ``spec.afd_config`` names."""
        name = spec.afd_config.connector
        if name not in cls._registry:
            raise ValueError(
                f"AFD connector {name!r} is not available in this build; available: {cls.names()}"
            )
        return cls._registry[name]()(spec, exchange)


for _name, _class in [
    ("gloo", "GlooDataPlane"),
    ("ipc", "IpcDataPlane"),
    ("nccl", "NcclDataPlane"),
]:
    AFDConnectorFactory.register_connector(
        _name, f"vllm.distributed.afd_transfer.afd_connector.{_name}_connector", _class
    )
