# SPDX-License-Identifier: Apache-2.0
"""Failover: an attention rank outlives its FFN rank (``failover_timeout_s``).

An FFN rank holds no request state and no KV cache, so losing one costs
only the forward it was serving. The attention worker's forward methods are
wrapped with ``redo_on_ffn_loss``: when the FFN rank is lost during one,
the connector waits for a replacement (``AFDConnectorBase.replace_ffn_rank``)
and the forward runs again with the same inputs. The scheduler's state is
untouched (it commits a step only after the forward returns), the KV cache
entries the first try wrote are written again with the same values, and
the replacement resumes the step count where the lost rank stopped.

What a redo cannot repeat decides where failover is refused
(``verify_afd_failover``): layers that update a recurrent state in place
(linear attention, Mamba) would apply the step twice; a tensor-parallel
attention rank's other TP ranks wait in collectives where no error reaches
them; micro-batch overlap runs the forward in threads of its own; and the
device connectors' CUDA graphs hold the lost rank's buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from vllm.distributed.afd_transfer import get_afd_connector
from vllm.distributed.afd_transfer.handshake import AFDConnectionError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_P = ParamSpec("_P")
_R = TypeVar("_R")


def verify_afd_failover(vllm_config: VllmConfig) -> None:
    """Refuse ``failover_timeout_s`` where a redone forward would not be the
    same forward (see the module docstring)."""
    afd = vllm_config.afd_config
    if afd is None or afd.role != "attention" or not afd.failover_timeout_s:
        return
    reasons = []
    if afd.connector != "gloo":
        reasons.append(
            f"the {afd.connector} connector's transfers (and the CUDA graphs that captured "
            "them) hold the lost FFN rank's buffers; failover runs on the gloo connector"
        )
    model = vllm_config.model_config
    if model is not None and model.is_hybrid:
        reasons.append(
            f"{model.architecture} keeps a recurrent state that each forward updates in "
            "place, so a redone forward would apply its step twice"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1:
        reasons.append(
            f"a tensor-parallel attention rank (tensor_parallel_size="
            f"{parallel.tensor_parallel_size}) cannot redo a forward on all its TP ranks"
        )
    if parallel.use_ubatching:
        reasons.append("micro-batch overlap (--enable-dbo, --ubatch-size) runs the forward "
                       "in threads that a redo does not reach")  # fmt: skip
    if reasons:
        raise ValueError(
            "AFD failover_timeout_s cannot be used here: " + "; ".join(reasons)
            + ". Set failover_timeout_s to 0: a lost FFN rank then ends the deployment."
        )  # fmt: skip


def redo_on_ffn_loss(forward: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wraps a worker method that runs one forward (announcing it to the FFN
    rank first) and nothing the scheduler commits. On an attention rank with
    ``failover_timeout_s``, losing the FFN rank during it means waiting for a
    replacement and running it again; without, it only calls the method."""

    @functools.wraps(forward)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        while True:
            try:
                return forward(*args, **kwargs)
            except AFDConnectionError as lost:
                connector = get_afd_connector()
                if connector is None or not connector.can_fail_over:
                    raise
                connector.replace_ffn_rank(lost)  # raises if none comes in time

    return run
