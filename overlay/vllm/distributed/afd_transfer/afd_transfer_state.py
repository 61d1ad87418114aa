# SPDX-License-Identifier: Apache-2.0
"""The process's AFD connector, one per rank (``vllm.afd.connection`` creates
and connects it; the data-plane ops and the runner hooks look it up here)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.afd_connector.base import AFDConnectorBase

_AFD_CONNECTOR: AFDConnectorBase | None = None

_P = ParamSpec("_P")
_R = TypeVar("_R")


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


def afd_step(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wraps a worker's step method: when it raises, this rank's shutdown
    message will say it stopped after a failure. An FFN rank tells by it a
    peer that lost a data-parallel peer mid-run from one that finished."""

    @functools.wraps(method)
    def step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except BaseException:
            if _AFD_CONNECTOR is not None:
                _AFD_CONNECTOR.step_failed = True
            raise

    return step
