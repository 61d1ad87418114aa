# SPDX-License-Identifier: Apache-2.0
"""The process's AFD connector, one per rank (``vllm.afd.connection`` creates
and connects it; the data-plane ops and the runner hooks look it up here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase

_AFD_CONNECTOR: AFDConnectorBase | None = None


def get_afd_connector() -> AFDConnectorBase | None:
    """The connector of this process, or None when AFD is off."""
    return _AFD_CONNECTOR


def set_afd_connector(connector: AFDConnectorBase) -> None:
    global _AFD_CONNECTOR
    if _AFD_CONNECTOR is not None:
        raise RuntimeError("this process already has an AFD connector")
    _AFD_CONNECTOR = connector


def ensure_afd_connector_shutdown() -> None:
    global _AFD_CONNECTOR
    if _AFD_CONNECTOR is not None:
        _AFD_CONNECTOR.close()
        _AFD_CONNECTOR = None
