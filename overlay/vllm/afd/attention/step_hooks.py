# SPDX-License-Identifier: Apache-2.0
"""The attention side's model-runner hooks: one control payload per forward.

The runners call these right before every forward the FFN rank must mirror:

* ``publish_forward_step``: eager forwards (real steps, profile run, warm-up
  and capture dummies) and, on Model Runner V1, CUDAGraphWrapper replays;
  inside the forward context the forward uses.
* ``afd_graph_capture`` / ``publish_capture_forward``: Model Runner V2's
  capture loop, one warm-up and one capture forward per FULL descriptor, in
  vLLM's native order, checked as it goes. With micro-batching, V2 captures
  a micro-batched "twin" beside the graph of a decode size: its forwards run
  in the micro-batch threads, each stage in a forward context of its own and
  none around them, so they are announced with the stages they run.
* ``publish_graph_replay``: right before a V2 FULL replay, which enters no
  forward context and runs no Python inside the graph; a twin's replay
  carries its stages (``twin_stage_counts``).
* ``kernel_warmup_forwards``: around vLLM's kernel warm-up, whose made-up
  requests step through execute_model as real steps do; they are announced
  as warm-ups.

Without AFD every hook returns at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.afd.attention.dbo import stage_token_counts, twin_stage_counts
from vllm.afd.ffn.graphs import CaptureOrderError
from vllm.config import CUDAGraphMode
from vllm.distributed.afd_transfer import get_attention_endpoint
from vllm.forward_context import DPMetadata, get_forward_context

if TYPE_CHECKING:
    from vllm.v1.worker.ubatch_utils import UBatchSlices


def peer_token_counts(
    peer_ranks: list[int],
    num_tokens: int,
    dp_metadata: DPMetadata | None,
    alone_as: int | None = None,
) -> tuple[int, ...]:
    """How many tokens each attention peer of this rank's FFN rank sends.

    With one peer that is this forward's own count. With several, the peers
    are data-parallel ranks stepping in lockstep, and the forward context
    carries every rank's count (``vllm/afd/attention/lockstep.py`` turns that on).
    An attention rank of its own (``alone_as``: its peer index) steps
    without the others and announces its own count only, the others' 0.
    """
    if alone_as is not None:
        return tuple(num_tokens if p == alone_as else 0 for p in range(len(peer_ranks)))
    if len(peer_ranks) == 1:
        return (num_tokens,)
    if dp_metadata is None:
        raise RuntimeError(
            f"AFD attention peers {peer_ranks} share an FFN rank, but this forward has no "
            "data-parallel token counts; the attention ranks must run as the "
            "data-parallel ranks of one deployment (data_parallel_size = num_attention_ranks)"
        )
    counts = dp_metadata.num_tokens_across_dp_cpu.tolist()
    return tuple(int(counts[rank]) for rank in peer_ranks)


_in_kernel_warmup = False


@contextmanager
def kernel_warmup_forwards() -> Iterator[None]:
    """Around vLLM's kernel warm-up (the worker's ``warmup_kernels`` and, from
    vLLM 0.34, its KV-cache sizing steps): made-up requests step through
    execute_model like real ones. The FFN rank must see warm-ups: no tokens
    served, and not the start of serving. From vLLM 0.32 they run before the
    graph capture, where a standby asking for the served rank's graphs would
    otherwise be offered none."""
    global _in_kernel_warmup
    _in_kernel_warmup = True
    try:
        yield
    finally:
        _in_kernel_warmup = False


def publish_forward_step(
    num_tokens: int,
    *,
    is_profile: bool = False,
    is_dummy: bool = False,
    is_graph_capturing: bool = False,
) -> None:
    """Tell the FFN rank about the forward that is about to run in the current
    forward context (``num_tokens`` padded as the forward runs it)."""
    endpoint = get_attention_endpoint()
    if endpoint is None:
        return
    context = get_forward_context()
    mode = context.cudagraph_runtime_mode
    replaying = mode == CUDAGraphMode.FULL and not is_graph_capturing
    if replaying and not endpoint.failover.graphs_usable:
        # V1: the graph holds a lost NCCL communicator; CUDAGraphWrapper runs
        # the same forward eager, at the padded count the graph was captured for.
        mode = context.cudagraph_runtime_mode = CUDAGraphMode.NONE
    if context.ubatch_slices is not None:  # dual-batch overlap: two stages
        token_counts = stage_token_counts(context.ubatch_slices)
    else:
        token_counts = (
            peer_token_counts(
                endpoint.peer_ranks, num_tokens, context.dp_metadata, endpoint.alone_as
            ),
        )
    endpoint.publish_step(
        token_counts,
        is_warmup=(is_dummy or _in_kernel_warmup) and not is_profile,
        is_profile=is_profile,
        is_graph_capturing=is_graph_capturing,
        is_graph_replaying=mode == CUDAGraphMode.FULL and not is_graph_capturing,
    )


def publish_graph_replay(num_tokens: int, stages: int = 1) -> None:
    """Before a V2 FULL replay of a descriptor of ``num_tokens`` tokens in
    ``stages`` micro-batches (V2's ``num_ubatches``). Data-parallel ranks
    replay the same descriptor, so every peer sends as many; a micro-batched
    graph serves one peer (``verify_afd_dbo``) and carries the layout it was
    captured with."""
    endpoint = get_attention_endpoint()
    if endpoint is None:
        return
    flags = {"is_graph_replaying": True} | ({"is_warmup": True} if _in_kernel_warmup else {})
    if stages > 1:
        counts = tuple((n,) for n in twin_stage_counts(num_tokens, stages))
        endpoint.publish_step(counts, **flags)
        return
    if endpoint.alone_as is None:  # data-parallel peers replay the same descriptor
        counts = (num_tokens,) * len(endpoint.peer_ranks)
    else:
        counts = peer_token_counts(endpoint.peer_ranks, num_tokens, None, endpoint.alone_as)
    endpoint.publish_step((counts,), **flags)


Layout = tuple[int, ...]
"""A capture forward's tokens, stage by stage (one entry without micro-batching)."""


def _describe(layout: Layout) -> str:
    if len(layout) == 1:
        return f"{layout[0]}"
    return f"{sum(layout)} in {len(layout)} stages ({' + '.join(map(str, layout))})"


class CaptureSequence:
    """The forwards a capture loop must run: for each FULL descriptor in
    native order, ``warmups`` warm-up forwards, then one capture. Each
    descriptor is its token count, or its stages' counts when micro-batched."""

    def __init__(self, layouts: Iterable[int | Layout], warmups: int = 1) -> None:
        phases = ["warm-up"] * warmups + ["capture"]
        self._expected = deque((phase, _layout(n)) for n in layouts for phase in phases)

    def check(self, num_tokens: int | Layout, capturing: bool) -> None:
        layout = _layout(num_tokens)
        ran = ("capture" if capturing else "warm-up", layout)
        if not self._expected:
            raise CaptureOrderError(
                f"vLLM's graph capture ran a {ran[0]} forward of {_describe(layout)} tokens "
                "after the last FULL descriptor; the AFD capture hooks no longer match the "
                "capture loop"
            )
        expected = self._expected.popleft()
        if ran != expected:
            raise CaptureOrderError(
                f"vLLM's graph capture ran a {ran[0]} forward of {_describe(layout)} tokens "
                f"where the AFD hooks expected a {expected[0]} of {_describe(expected[1])}; "
                "the FFN rank would pair its graphs with the wrong layouts (check the V2 "
                "cudagraph patches)"
            )

    def finish(self) -> None:
        if self._expected:
            left = [(phase, _describe(layout)) for phase, layout in self._expected]
            raise CaptureOrderError(
                f"vLLM's graph capture ended with forwards still expected: {left}; the AFD "
                "capture hooks no longer match the capture loop"
            )


def _layout(num_tokens: int | Layout) -> Layout:
    return (num_tokens,) if isinstance(num_tokens, int) else tuple(num_tokens)


def descriptor_layout(desc: Any) -> Layout:
    """The stages' token counts of a V2 batch descriptor (``num_ubatches``
    from vLLM 0.30 on; 1 before)."""
    return twin_stage_counts(desc.num_tokens, getattr(desc, "num_ubatches", 1))


_capture: CaptureSequence | None = None


@contextmanager
def afd_graph_capture(full_descriptors: Iterable[Any]) -> Iterator[None]:
    """Around V2's capture loop: the FULL descriptors it will capture, in
    native order (``num_tokens`` and ``num_ubatches`` are read from each)."""
    global _capture
    if get_attention_endpoint() is None:
        yield
        return
    _capture = CaptureSequence(descriptor_layout(desc) for desc in full_descriptors)
    try:
        yield
        _capture.finish()
    finally:
        _capture = None


def publish_capture_forward(
    num_tokens: int, warmup: bool, ubatch_slices: UBatchSlices | None = None
) -> None:
    """Inside V2's capture loop, before a warm-up (``warmup``) or capture
    forward of ``num_tokens`` tokens: in its forward context, or for a
    micro-batched twin with the ``ubatch_slices`` its threads run."""
    if _capture is None:
        return
    if ubatch_slices is None:
        _capture.check(num_tokens, capturing=not warmup)
        publish_forward_step(num_tokens, is_dummy=True, is_graph_capturing=not warmup)
        return
    _capture.check(tuple(s.num_tokens for s in ubatch_slices), capturing=not warmup)
    endpoint = get_attention_endpoint()
    assert endpoint is not None  # _capture is set only with one
    endpoint.publish_step(
        stage_token_counts(ubatch_slices), is_warmup=True, is_graph_capturing=not warmup
    )
