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
On the nccl connector (``DeviceRedoFailover``) a lost FFN rank leaves the
forward's NCCL kernels waiting where no error reaches: the watchdog aborts
the communicator, each forward is checked once the GPU has run it
(``check_forward``, through the redos above) and runs again with the
replacement's new communicator. The graphs captured before hold the old
one, so a forward about to replay one runs eager instead: on V1 the
announcement hook sets its forward context's mode, on V2 the FULL replay
returns None and the runner runs the step eager (``eager_after_graph_loss``,
patch 0027), at the graph's token counts, so the kernels stay the graph's.

What no failover covers decides where it is refused
(``verify_afd_failover``): micro-batch overlap runs the forward in threads
of its own, on either runner, which no redo reaches, so its stages resume
in place, each from its own layer, on ipc only and where the FFN rank
serves one attention rank; and on nccl a forward that cannot run twice
cannot resume in place either (NCCL kernels record no layer reached).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from vllm.config import CUDAGraphMode
from vllm.distributed.afd_transfer import get_attention_endpoint
from vllm.distributed.afd_transfer.failover import GraphsLostError, RedoFailover, redo_limits
from vllm.distributed.afd_transfer.handshake import AFDConnectionError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_P = ParamSpec("_P")
_R = TypeVar("_R")
_D = TypeVar("_D")


def verify_afd_failover(vllm_config: VllmConfig) -> None:
    """Refuse ``failover_timeout_s`` where no failover keeps the forward in
    flight (see the module docstring)."""
    afd = vllm_config.afd_config
    if afd is None or afd.role != "attention" or not afd.failover_timeout_s:
        return
    reasons = []
    shares_its_ffn_rank = afd.num_attention_ranks > afd.num_ffn_ranks
    in_place = redo_limits(vllm_config)
    if afd.connector == "nccl" and in_place:
        reasons.append(
            f"on the nccl connector a lost FFN rank's forward runs again ({'; '.join(in_place)}"
            "): its transfers wait in NCCL kernels, which record no layer they reached, and "
            "the abort that ends them ends every transfer of the communicator, so the forward "
            "cannot resume in place; use the ipc connector (one node) or gloo"
        )
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
    without, it only calls the method. A forward that was about to replay a
    graph holding a lost NCCL communicator runs again eager (the runner's
    announcement hook sets its forward context's mode)."""

    @functools.wraps(forward)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        while True:
            try:
                return _checked(forward(*args, **kwargs))
            except AFDConnectionError as lost:
                _replace_lost_ffn_rank(lost)
            except GraphsLostError:
                pass

    return run


def _checked(output: _R) -> _R:
    """A forward's ``output``, once the failover has checked the forward
    (``Failover.check_forward``)."""
    endpoint = get_attention_endpoint()
    if endpoint is not None:
        endpoint.failover.check_forward()
    return output


def _replace_lost_ffn_rank(lost: AFDConnectionError) -> RedoFailover:
    """Within a redo, the FFN rank lost (``lost``): with failover on the host,
    wait for a replacement and return the failover; else re-raise."""
    endpoint = get_attention_endpoint()
    failover = endpoint.failover if endpoint is not None else None
    if not isinstance(failover, RedoFailover):
        raise lost  # in place, the failover itself failed: nothing to redo
    failover.replace_ffn_rank(lost)  # raises if none comes in time
    return failover


def rerun_on_ffn_loss(
    forward: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs
) -> _R | None:
    """``forward(*args, **kwargs)``: one forward that announces its own step
    (Model Runner V2's FULL graph replay, patch 0011). Losing the FFN rank
    during it, with failover on the host, means waiting for a replacement
    and running it again; otherwise it only calls it. Returns None where
    the graph holds a lost NCCL communicator: the runner then runs the step
    eager (patch 0027, with ``eager_after_graph_loss``)."""
    while True:
        try:
            return _checked(forward(*args, **kwargs))
        except AFDConnectionError as lost:
            _replace_lost_ffn_rank(lost)
        except GraphsLostError:
            return None


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
            return _checked(forward(*args, **kwargs))
        except AFDConnectionError as lost:
            _replace_lost_ffn_rank(lost).announce_again()


def eager_after_graph_loss(batch_desc: _D) -> _D:
    """Model Runner V2's batch descriptor for a step about to run (patch
    0027): once the graphs hold a lost NCCL communicator
    (``DeviceRedoFailover``), a FULL one turned eager. Its inputs and
    attention metadata were prepared for the graph, so the graph's kernels
    run outside it. Else ``batch_desc``."""
    endpoint = get_attention_endpoint()
    if (
        endpoint is None
        or endpoint.failover.graphs_usable
        or batch_desc.cg_mode != CUDAGraphMode.FULL
    ):
        return batch_desc
    return dataclasses.replace(batch_desc, cg_mode=CUDAGraphMode.NONE)
