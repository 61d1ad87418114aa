# SPDX-License-Identifier: Apache-2.0
"""Failover on the attention worker: where a lost FFN rank's forward is redone.

How failover works lives in ``vllm.distributed.afd_transfer.failover``: on
ipc the forward in flight resumes in place; on gloo its transfer fails, and
the attention worker's forward methods, wrapped with ``redo_on_ffn_loss``,
wait for a replacement and run again with the same inputs. The scheduler's
state is untouched (it commits a step only after the forward returns), the
KV cache entries the first try wrote are written again with the same
values, and the replacement resumes the step count where the lost rank
stopped.

What a redo cannot repeat decides where failover is refused
(``verify_afd_failover``): layers that update a recurrent state in place
(linear attention, Mamba) would apply the step twice; a tensor-parallel
attention rank's other TP ranks wait in collectives where no error reaches
them; micro-batch overlap runs the forward in threads of its own; Model
Runner V2's forward is not wrapped (and vLLM 0.34 on runs nothing else);
and the nccl connector's graphs hold a communicator that includes the lost
rank (the ipc connector's graphs hold only the attention rank's own buffer,
which the replacement maps again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from vllm.afd.runners import has_model_runner_v1, runs_model_runner_v2
from vllm.distributed.afd_transfer import get_attention_endpoint
from vllm.distributed.afd_transfer.failover import RedoFailover
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
    if afd.connector == "nccl":
        reasons.append(
            "the nccl connector's communicator includes the FFN rank, and NCCL cannot take a "
            "member out of a communicator: a lost one leaves only ncclCommAbort, after which "
            "every CUDA graph that captured the communicator's kernels is unusable. A "
            "replacement would need a new communicator and every graph captured again while "
            "serving, which vLLM does not do; failover runs on the gloo and ipc connectors"
        )
    if runs_model_runner_v2(vllm_config):
        fix = (
            "set VLLM_USE_V2_MODEL_RUNNER=0"
            if has_model_runner_v1()
            else "this vLLM has no Model Runner V1 (vLLM 0.34 removed it), so failover "
            "needs vLLM 0.33 or earlier"
        )
        reasons.append(
            "Model Runner V2 runs its forward where a redo does not reach (the redo wraps "
            f"Model Runner V1's _model_forward); {fix}"
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
            endpoint = get_attention_endpoint()
            try:
                return forward(*args, **kwargs)
            except AFDConnectionError as lost:
                failover = endpoint.failover if endpoint is not None else None
                if not isinstance(failover, RedoFailover):
                    raise  # in place, the failover itself failed: nothing to redo
                failover.replace_ffn_rank(lost)  # raises if none comes in time

    return run
