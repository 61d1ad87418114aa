# SPDX-License-Identifier: Apache-2.0
"""Failover on the attention worker: where a lost FFN rank's forward is redone.

How failover works lives in ``vllm.distributed.afd_transfer.failover``: on
ipc the forward in flight resumes in place, on either model runner (a
runner only announces each step, through its hooks; the forward waits on
the device, where no runner code is involved); on gloo its transfer fails,
and the runner's forward, run through one of the redos below, waits for a
replacement and runs again with the same inputs:

* Model Runner V1: ``_model_forward`` (announce, then the model) and the
  worker's dummy step of an idle data-parallel rank, wrapped with
  ``redo_on_ffn_loss`` (patch 0025);
* Model Runner V2: ``execute_model``'s model call alone (patch 0027), after
  the state updates, the KV connector's ``pre_forward``, EPLB's
  ``prepare_forward``, the step timing and the announcement (patch 0010),
  which a redo does not repeat: the eager and piecewise forwards through
  ``rerun_announced_on_ffn_loss``, which announces the kept step again, and
  the FULL graph replay, which announces itself (patch 0011), through
  ``rerun_on_ffn_loss``. Its output is taken after the forward returns,
  once (``sample_tokens``, asynchronous output).

The scheduler's state is untouched (it commits a step only after the
forward returns), the KV cache entries the first try wrote are written
again with the same values, and the replacement resumes the step count
where the lost rank stopped.

Where a redo would not be the same forward (``redo_limits``: layers that
update a recurrent state in place, such as linear attention and Mamba,
would apply the step twice; a tensor-parallel attention rank's other TP
ranks wait in collectives that no error reaches), the gloo connector
resumes in place instead (``HostInPlaceFailover``), as ipc always does.
What no failover covers decides where it is refused
(``verify_afd_failover``): micro-batch overlap runs the forward in threads
of its own, on either runner, which no redo reaches, so its stages resume
in place, each from its own layer, on ipc only and where the FFN rank
serves one attention rank; and the nccl connector's graphs hold a
communicator that includes the lost rank (the ipc connector's graphs hold
only the attention rank's own buffer, which the replacement maps again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from vllm.distributed.afd_transfer import get_attention_endpoint
from vllm.distributed.afd_transfer.failover import RedoFailover, redo_limits
from vllm.distributed.afd_transfer.handshake import AFDConnectionError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_P = ParamSpec("_P")
_R = TypeVar("_R")


def verify_afd_failover(vllm_config: VllmConfig) -> None:
    """Refuse ``failover_timeout_s`` where no failover keeps the forward in
    flight (see the module docstring)."""
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
    shares_its_ffn_rank = afd.num_attention_ranks > afd.num_ffn_ranks
    in_place = redo_limits(vllm_config)
    if afd.separate_attention_ranks and shares_its_ffn_rank and in_place:
        reasons.append(
            "this attention rank resumes in place (" + "; ".join(in_place)
            + "), and a replacement FFN rank resumes one forward for all its peers, while "
            "attention ranks of their own (attention_rank) count their steps apart; start "
            "them as the data-parallel ranks of one deployment to keep failover"
        )  # fmt: skip
    if in_place and vllm_config.model_config is not None:
        from vllm.afd.models.registry import get_afd_model_spec

        architecture = vllm_config.model_config.architecture
        if get_afd_model_spec(architecture).exchanges_per_layer > 1:
            reasons.append(
                f"this attention rank resumes in place ({'; '.join(in_place)}), and "
                f"{architecture}'s FFN rank keeps a layer's shortcut MoE output between the "
                "layer's two exchanges, which a replacement that resumes mid-layer lacks"
            )
    if vllm_config.parallel_config.use_ubatching:
        if afd.connector != "ipc":
            reasons.append(
                "micro-batch overlap (--enable-dbo, --ubatch-size) runs the forward in threads "
                "that a redo does not reach (on either model runner); its stages resume in "
                "place on the ipc connector only"
            )
        elif shares_its_ffn_rank:
            reasons.append(
                "micro-batch overlap's stages resume in place where an FFN rank serves one "
                "attention rank: each stage's slot holds only its last layer's rows, so a "
                "replacement cannot run a layer again for a peer that stands past it; give "
                "each attention rank an FFN rank of its own, or drop --enable-dbo and "
                "--ubatch-size"
            )
    if reasons:
        raise ValueError(
            "AFD failover_timeout_s cannot be used here: " + "; ".join(reasons)
            + ". Set failover_timeout_s to 0: a lost FFN rank then ends the deployment."
        )  # fmt: skip


def redo_on_ffn_loss(forward: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wraps a worker method that runs one forward (announcing it to the FFN
    rank first) and nothing the scheduler commits (Model Runner V1's, patch
    0025). On an attention rank with ``failover_timeout_s``, losing the FFN
    rank during it means waiting for a replacement and running it again;
    without, it only calls the method."""

    @functools.wraps(forward)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        while True:
            try:
                return forward(*args, **kwargs)
            except AFDConnectionError as lost:
                _replace_lost_ffn_rank(lost)

    return run


def _replace_lost_ffn_rank(lost: AFDConnectionError) -> RedoFailover:
    """Within a redo, the FFN rank lost (``lost``): with failover on the host,
    wait for a replacement and return the failover; else re-raise."""
    endpoint = get_attention_endpoint()
    failover = endpoint.failover if endpoint is not None else None
    if not isinstance(failover, RedoFailover):
        raise lost  # in place, the failover itself failed: nothing to redo
    failover.replace_ffn_rank(lost)  # raises if none comes in time
    return failover


def rerun_on_ffn_loss(forward: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``forward(*args, **kwargs)``: one forward that announces its own step
    (Model Runner V2's FULL graph replay, patch 0011). Losing the FFN rank
    during it, with failover on the host, means waiting for a replacement
    and running it again; otherwise it only calls it."""
    while True:
        try:
            return forward(*args, **kwargs)
        except AFDConnectionError as lost:
            _replace_lost_ffn_rank(lost)


def rerun_announced_on_ffn_loss(
    forward: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs
) -> _R:
    """``forward(*args, **kwargs)``: one forward whose step was announced
    right before it (Model Runner V2's eager and piecewise forwards, patch
    0010). Losing the FFN rank during it, with failover on the host, means
    waiting for a replacement, announcing the same step to it again and
    running it again with the same inputs; what the runner did before the
    announcement is not repeated. Otherwise it only calls it."""
    while True:
        try:
            return forward(*args, **kwargs)
        except AFDConnectionError as lost:
            _replace_lost_ffn_rank(lost).announce_again()
