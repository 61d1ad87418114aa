"""Dual-batch overlap under AFD, below the engine: where a step splits into
its two stages, what the payload says of them, and which layouts are refused.

vLLM's CPU platform turns DBO off ("Dual-Batch Overlap is not supported on
CPU"): micro-batch threads hand a CUDA stream to each other. The engine path
runs in the GPU tests; here the pieces it calls are checked alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from vllm.afd.attention.dbo import (
    afd_micro_batching,
    request_boundary_split,
    stage_token_counts,
    verify_afd_dbo,
)
from vllm.config import AFDConfig
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices


@pytest.mark.parametrize(
    ("scheduled", "padded", "split"),
    [
        ([1] * 8, 8, None),  # decode: the middle is a request boundary, vLLM's split
        ([1] * 6, 8, None),  # padded decode: likewise
        ([7, 1], 8, 7),  # a prefill chunk and a decode: no request straddles
        ([1, 7], 8, 1),
        ([3, 5, 4], 12, 8),  # the boundary nearest the middle (6)
        ([300, 300, 100], 704, 300),
        ([600], 608, None),  # one request: it has to straddle
    ],
)
def test_split_falls_on_the_request_boundary_nearest_the_middle(scheduled, padded, split):
    assert request_boundary_split(np.array(scheduled), padded) == split


@pytest.mark.parametrize(("scheduled", "padded"), [([7, 1], 8), ([3, 5, 4], 12), ([1] * 6, 8)])
def test_vllm_slices_at_that_split_keep_every_request_in_one_stage(scheduled, padded):
    split = request_boundary_split(np.array(scheduled), padded)
    slices, padded_slices = maybe_create_ubatch_slices(
        True, np.array(scheduled), padded, len(scheduled), 2, split_point=split
    )
    first, second = slices
    assert first.request_slice.stop == second.request_slice.start  # no request in both
    counts = stage_token_counts(padded_slices)
    assert len(counts) == 2 and sum(c for (c,) in counts) == padded
    if split is not None:
        assert counts[0] == (split,)


def test_stage_counts_are_what_each_stage_runs():
    _, padded_slices = maybe_create_ubatch_slices(True, np.array([1] * 6), 8, 8, 2)
    assert stage_token_counts(padded_slices) == ((4,), (4,))  # the graph key's layout


def _config(
    num_ubatches: int,
    topology: tuple[int, int] = (1, 1),
    enable_dbo: bool = False,
    tensor_parallel_size: int = 1,
):
    parallel = SimpleNamespace(
        use_ubatching=num_ubatches > 1,
        num_ubatches=num_ubatches,
        ubatch_size=num_ubatches,
        enable_dbo=enable_dbo,
        tensor_parallel_size=tensor_parallel_size,
    )
    afd = AFDConfig(role="attention", num_attention_ranks=topology[0], num_ffn_ranks=topology[1])
    return SimpleNamespace(afd_config=afd, parallel_config=parallel)


def test_any_stage_count_with_one_peer_per_ffn_rank_is_accepted():
    verify_afd_dbo(_config(2))
    verify_afd_dbo(_config(3))  # --ubatch-size 3
    verify_afd_dbo(_config(2, (2, 2)))
    verify_afd_dbo(_config(1, (2, 1)))  # no micro-batching: any topology


def test_more_stages_than_the_data_planes_hold_are_refused():
    verify_afd_dbo(_config(4))
    with pytest.raises(ValueError, match="at most 4 overlap stages"):
        verify_afd_dbo(_config(5))


def test_enable_dbo_with_a_larger_ubatch_size_is_refused():
    config = _config(3, enable_dbo=True)
    with pytest.raises(ValueError, match="pass one of them"):
        verify_afd_dbo(config)


def test_three_stages_keep_vllms_even_split_and_report_each_stage():
    scheduled = np.array([7, 1, 4])
    assert request_boundary_split(scheduled, 12, num_stages=3) is None
    _, padded_slices = maybe_create_ubatch_slices(True, scheduled, 12, 3, 3)
    assert stage_token_counts(padded_slices) == ((4,), (4,), (4,))


def test_tensor_parallel_attention_is_refused_with_dbo():
    with pytest.raises(ValueError, match="with tensor_parallel_size=2 drop --enable-dbo"):
        verify_afd_dbo(_config(2, enable_dbo=True, tensor_parallel_size=2))


def test_several_peers_per_ffn_rank_are_refused_with_dbo():
    with pytest.raises(ValueError, match="one attention rank per FFN rank"):
        verify_afd_dbo(_config(2, (2, 1)))


def test_without_an_afd_attention_connector_vllm_keeps_its_own_dbo_rules():
    parallel = SimpleNamespace(use_ubatching=True)
    assert not afd_micro_batching(parallel)
