"""What the attention side puts in each payload: per-peer token counts, and
on Model Runner V2 the stages of its micro-batched steps and graphs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.afd.attention import step_hooks
from vllm.afd.attention.step_hooks import peer_token_counts
from vllm.afd.ffn.graphs import CaptureOrderError, FFNGraphCache
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.afd_transfer.accounting import AttentionAccounting
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.step_stats import NULL_TIMELINE, StepKind
from vllm.forward_context import DPMetadata
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices


def test_one_peer_sends_its_own_count():
    assert peer_token_counts([3], 7, None) == (7,)


def test_several_peers_take_their_counts_from_the_dp_ranks():
    dp = DPMetadata(torch.tensor([5, 1, 9, 2], dtype=torch.int32))
    assert peer_token_counts([0, 1], 5, dp) == (5, 1)
    assert peer_token_counts([2, 3], 9, dp) == (9, 2)


def test_an_attention_rank_of_its_own_announces_only_its_own_count():
    assert peer_token_counts([2, 3], 9, None, alone_as=1) == (0, 9)
    assert peer_token_counts([2, 3], 9, None, alone_as=0) == (9, 0)


def test_several_peers_without_dp_counts_is_a_clear_error():
    with pytest.raises(RuntimeError, match="data_parallel_size = num_attention_ranks"):
        peer_token_counts([0, 1], 5, None)


# --- Model Runner V2's micro-batched graphs ("twins") --------------------------


class FakeEndpoint:
    """An attention endpoint that keeps what it announces."""

    peer_ranks = [0]
    alone_as = None

    def __init__(self) -> None:
        self.sent: list[ControlPayload] = []

    def publish_step(self, token_counts, **flags) -> None:
        self.sent.append(ControlPayload(step_id=len(self.sent), token_counts=token_counts, **flags))


@pytest.fixture
def endpoint(monkeypatch) -> FakeEndpoint:
    fake = FakeEndpoint()
    monkeypatch.setattr(step_hooks, "get_attention_endpoint", lambda: fake)
    return fake


def in_forward_context(monkeypatch, ubatch_slices=None) -> None:
    """The forward context V2's capture loop or eager branch opens."""
    context = SimpleNamespace(
        cudagraph_runtime_mode=CUDAGraphMode.NONE, ubatch_slices=ubatch_slices, dp_metadata=None
    )
    monkeypatch.setattr(step_hooks, "get_forward_context", lambda: context)


def dummy_split(num_tokens: int, stages: int, split_point=None):
    """How V2 splits a capture's dummy batch of one token per request."""
    _, padded = maybe_create_ubatch_slices(
        True, np.ones(num_tokens, dtype=np.int32), num_tokens, num_tokens, stages, split_point
    )
    return padded


def desc(num_tokens: int, num_ubatches: int = 1) -> SimpleNamespace:
    """A V2 FULL BatchExecutionDescriptor, as the capture hooks read it."""
    return SimpleNamespace(num_tokens=num_tokens, num_ubatches=num_ubatches)


# V2's FULL descriptors in capture order: by size, each twin after its graph.
DESCRIPTORS = [desc(8), desc(8, 2), desc(4), desc(4, 2), desc(1)]


def capture_loop(monkeypatch, descriptors=DESCRIPTORS, split_point=None) -> None:
    """V2's capture loop with 0011's and 0028's hooks: one warm-up and one
    capture forward per descriptor; a twin's in its micro-batch threads."""
    with step_hooks.afd_graph_capture(descriptors):
        for d in descriptors:
            for warmup in (True, False):
                if d.num_ubatches == 1:
                    in_forward_context(monkeypatch)
                    step_hooks.publish_capture_forward(d.num_tokens, warmup)
                else:
                    slices = dummy_split(d.num_tokens, d.num_ubatches, split_point)
                    step_hooks.publish_capture_forward(d.num_tokens, warmup, slices)


@pytest.mark.parametrize(
    ("alone_as", "announced"), [(None, ((8, 8),)), (1, ((0, 8),))], ids=["dp-peers", "own-rank"]
)
def test_a_v2_replay_announces_every_peer_sharing_the_ffn_rank(endpoint, alone_as, announced):
    """Data-parallel peers replay the same descriptor, so each sends its
    tokens; an attention rank of its own sends alone. A V2 replay runs
    outside any forward context: no data-parallel counts to read."""
    endpoint.peer_ranks, endpoint.alone_as = [2, 3], alone_as
    step_hooks.publish_graph_replay(8)
    [replay] = endpoint.sent
    assert replay.token_counts == announced and replay.is_graph_replaying


def test_v2_twins_are_announced_with_their_stages_and_replayed_as_captured(endpoint, monkeypatch):
    capture_loop(monkeypatch)
    # Serving: replays of a decode graph and of its twin, a micro-batched eager step.
    step_hooks.publish_graph_replay(8)
    step_hooks.publish_graph_replay(8, stages=2)
    step_hooks.publish_graph_replay(4, stages=2)
    in_forward_context(monkeypatch, ubatch_slices=dummy_split(6, 2, split_point=5))
    step_hooks.publish_forward_step(6)

    captures = [p.token_counts for p in endpoint.sent if p.is_graph_capturing]
    assert captures == [((8,),), ((4,), (4,)), ((4,),), ((2,), (2,)), ((1,),)]
    replays = [p.token_counts for p in endpoint.sent if p.is_graph_replaying]
    assert replays == [((8,),), ((4,), (4,)), ((2,), (2,))]
    assert endpoint.sent[-1].token_counts == ((5,), (1,)) and endpoint.sent[-1].is_real

    # The FFN rank captures each layout as announced and replays exactly those;
    # both roles count the same steps.
    ffn = FFNGraphCache(enabled=True)
    ffn._capture = lambda key, forward: ffn.graphs.__setitem__(key, SimpleNamespace(replay=int))
    attention = AttentionAccounting(0, NULL_TIMELINE)
    kinds = []
    for payload in endpoint.sent:
        kinds.append(ffn.run(payload, lambda: None))
        attention.count_step(payload)
    assert set(ffn.graphs) == set(captures)
    assert kinds[-4:] == [StepKind.REPLAY] * 3 + [StepKind.EAGER]
    assert ffn.stats.replays_without_graph == 0
    counted = ("captures", "replays", "eager", "micro_batched")
    assert [getattr(ffn.stats, c) for c in counted] == [getattr(attention.graph_stats, c)
                                                        for c in counted]  # fmt: skip
    assert (ffn.stats.captures, ffn.stats.replays, ffn.stats.micro_batched) == (5, 3, 7)


def test_a_twin_that_v2_splits_otherwise_than_announced_is_refused(endpoint, monkeypatch):
    """Replays announce the twin's layout from its descriptor alone: a capture
    whose stages differ from it stops the capture instead."""
    with pytest.raises(CaptureOrderError, match=r"warm-up forward of 8 in 2 stages \(3 \+ 5\)"):
        capture_loop(monkeypatch, [desc(8, 2)], split_point=3)


def test_a_twin_capture_left_unannounced_is_found(endpoint, monkeypatch):
    """The capture loop of a V2 without 0028's hook: its twins' forwards go
    unannounced, and the capture sequence says so when the loop ends."""
    with pytest.raises(CaptureOrderError, match="still expected"):
        with step_hooks.afd_graph_capture([desc(8), desc(8, 2)]):
            for warmup in (True, False):
                in_forward_context(monkeypatch)
                step_hooks.publish_capture_forward(8, warmup)


def test_kernel_warmup_steps_reach_the_ffn_rank_as_warmups(endpoint, monkeypatch):
    """vLLM's kernel warm-up (from 0.32 before the graph capture) steps
    made-up requests through execute_model: announced as warm-ups, the FFN
    rank neither counts them as served nor offers a standby its graphs
    before it serves (an offer made then would hold none)."""
    ffn = FFNGraphCache(enabled=True)
    ffn._capture = lambda key, forward: ffn.graphs.__setitem__(key, SimpleNamespace(replay=int))

    @step_hooks.kernel_warmup_forwards()  # as patch 0029 decorates vLLM's warm-up
    def warmup_kernels() -> None:
        in_forward_context(monkeypatch)
        step_hooks.publish_forward_step(5)  # a prefill of made-up requests
        step_hooks.publish_graph_replay(8)

    warmup_kernels()
    warmup_kernels()  # vLLM 0.34 runs it again to size an extensible KV cache
    warmups = list(endpoint.sent)
    assert len(warmups) == 4
    for payload in warmups:
        ffn.run(payload, lambda: None)
    assert all(p.is_warmup and not p.is_real for p in warmups)
    assert ffn.layouts_for_standby() is None
    capture_loop(monkeypatch, [desc(8), desc(4)])
    for payload in endpoint.sent[len(warmups) :]:
        ffn.run(payload, lambda: None)
    in_forward_context(monkeypatch)
    step_hooks.publish_forward_step(3)  # the first real step, after the block
    ffn.run(endpoint.sent[-1], lambda: None)
    assert endpoint.sent[-1].is_real
    assert sorted(ffn.layouts_for_standby()) == [((4,),), ((8,),)]
