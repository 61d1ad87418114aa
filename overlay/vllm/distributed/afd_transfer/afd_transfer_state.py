# SPDX-License-Identifier: Apache-2.0
"""The process's AFD endpoint, one per rank (``vllm.afd.connection`` creates
and connects it; the data-plane ops and the runner hooks look it up here)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint
    from vllm.distributed.afd_transfer.endpoint.base import AFDEndpoint
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint

_AFD_ENDPOINT: AFDEndpoint | None = None

_P = ParamSpec("_P")
_R = TypeVar("_R")


def get_afd_endpoint() -> AFDEndpoint | None:
    """The endpoint of this process, or None when AFD is off."""
    return _AFD_ENDPOINT


def get_attention_endpoint() -> AttentionEndpoint | None:
    """The endpoint of this process if it is an attention rank's."""
    endpoint = _AFD_ENDPOINT
    return endpoint if endpoint is not None and endpoint.role == "attention" else None  # type: ignore[return-value]


def get_ffn_endpoint() -> FFNEndpoint | None:
    """The endpoint of this process if it is an FFN rank's."""
    endpoint = _AFD_ENDPOINT
    return endpoint if endpoint is not None and endpoint.role == "ffn" else None  # type: ignore[return-value]


def set_afd_endpoint(endpoint: AFDEndpoint) -> None:
    global _AFD_ENDPOINT
    if _AFD_ENDPOINT is not None:
        raise RuntimeError("this process already has an AFD endpoint")
    _AFD_ENDPOINT = endpoint


def ensure_afd_connector_shutdown() -> None:
    """Close this process's endpoint, if it has one (the worker's shutdown)."""
    global _AFD_ENDPOINT
    if _AFD_ENDPOINT is not None:
        _AFD_ENDPOINT.close()
        _AFD_ENDPOINT = None


def afd_step(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wraps a worker's step method. When it raises, this rank's shutdown
    message will say it stopped after a failure: an FFN rank tells by it a
    peer that lost a data-parallel peer mid-run from one that finished. When
    it returns a step's output on an attention rank, that output carries the
    rank's AFD figures into vLLM's stats path (``_attach_attention_stats``)."""

    @functools.wraps(method)
    def step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            output = method(*args, **kwargs)
        except BaseException:
            endpoint = get_attention_endpoint()
            if endpoint is not None:
                endpoint.step_failed = True
            raise
        endpoint = get_attention_endpoint()
        if endpoint is not None:
            _attach_attention_stats(output, endpoint)
        return output

    return step


def _attach_attention_stats(output: object, endpoint: AttentionEndpoint) -> None:
    """Set ``ModelRunnerOutput.afd_stats`` (the AFD stats patch) to how the
    rank's figures grew since the last output that carried them; the
    scheduler passes them on in ``SchedulerStats.afd_stats`` to one
    front-end's Prometheus logger. An asynchronous output builds its
    ModelRunnerOutput later, in ``get_output``; the shared empty output
    stays untouched, and what grew meanwhile rides on a later output."""
    from vllm.v1.outputs import (
        EMPTY_MODEL_RUNNER_OUTPUT,
        AsyncModelRunnerOutput,
        ModelRunnerOutput,
    )

    if isinstance(output, AsyncModelRunnerOutput):
        get_output = output.get_output

        def get_output_with_stats() -> ModelRunnerOutput:
            result = get_output()
            if result is not EMPTY_MODEL_RUNNER_OUTPUT:
                result.afd_stats = endpoint.accounting.stats_to_report()
            return result

        output.get_output = get_output_with_stats  # type: ignore[method-assign]
    elif isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT:
        output.afd_stats = endpoint.accounting.stats_to_report()
