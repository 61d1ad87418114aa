"""Dual-batch overlap under AFD, below the engine: where a step splits into
its two stages, what the payload says of them, and which layouts are refused,
on Model Runner V1 and V2.

vLLM's CPU platform turns DBO off ("Dual-Batch Overlap is not supported on
CPU"): micro-batch threads hand a CUDA stream to each other, and Model Runner
V2 needs Triton. The engine path runs in the GPU tests; here the pieces it
calls are checked alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import vllm
from vllm.afd.attention import dbo
from vllm.afd.attention.dbo import (
    afd_micro_batching,
    request_boundary_split,
    stage_token_counts,
    twin_stage_counts,
    verify_afd_dbo,
)
from vllm.afd.runners import model_runner_v2_micro_batches
from vllm.config import AFDConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

from vllm_afd_dev.patchtool.series import ADDED, release_key
from vllm_afd_dev.patchtool.tree import release_of


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
    v2: bool = False,
    role: str = "attention",
    model=None,
    cudagraph_mode: CUDAGraphMode | None = None,
):
    parallel = SimpleNamespace(
        use_ubatching=num_ubatches > 1,
        num_ubatches=num_ubatches,
        ubatch_size=num_ubatches,
        enable_dbo=enable_dbo,
        tensor_parallel_size=tensor_parallel_size,
    )
    afd = AFDConfig(role=role, num_attention_ranks=topology[0], num_ffn_ranks=topology[1])
    return SimpleNamespace(
        afd_config=afd,
        parallel_config=parallel,
        use_v2_model_runner=v2,  # up to vLLM 0.33 the config decides the runner
        model_config=model,
        compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode),
    )


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
    # Model Runner V2's callers that never micro-batch pass no config.
    assert not afd_micro_batching(None)


@pytest.mark.parametrize(
    ("num_tokens", "stages", "counts"),
    [(8, 2, (4, 4)), (7, 2, (3, 4)), (9, 3, (3, 3, 3)), (10, 3, (3, 3, 4)), (5, 1, (5,))],
)
def test_a_micro_batched_graph_splits_evenly_the_last_stage_taking_the_rest(
    num_tokens, stages, counts
):
    assert twin_stage_counts(num_tokens, stages) == counts


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_twin_layout_is_vllms_split_of_its_dummy_batch(stages):
    """Model Runner V2 captures a micro-batched decode graph (a "twin") on a
    dummy batch of one token per request and splits it with vLLM's slicer,
    as it splits a step; the replays announce that split without the slices
    at hand, so it must be the slicer's (the capture hooks check it again
    against the stages V2 runs)."""
    for num_tokens in range(stages, 33):
        _, padded = maybe_create_ubatch_slices(
            True, np.ones(num_tokens, dtype=np.int32), num_tokens, num_tokens, stages
        )
        assert tuple(s.num_tokens for s in padded) == twin_stage_counts(num_tokens, stages)
        assert stage_token_counts(padded) == tuple(
            (n,) for n in twin_stage_counts(num_tokens, stages)
        )


def test_the_installed_model_runner_v2_micro_batches_from_the_release_that_added_it():
    """Read from the tree: V2's ubatch_utils module exists from vLLM 0.30 on,
    the release the patch tool knows for 0028's Requires: field."""
    added_in = ADDED["model-runner-v2-micro-batching"][1]
    installed = release_key(release_of(vllm.__version__))
    assert model_runner_v2_micro_batches() is (installed >= release_key(added_in))


@pytest.fixture
def v2_micro_batches(monkeypatch):
    """Model Runner V2 with micro-batching (vLLM 0.30 on), whichever vLLM is installed."""
    monkeypatch.setattr(dbo, "model_runner_v2_micro_batches", lambda: True)


@pytest.mark.parametrize("stages", [2, 3])
def test_model_runner_v2_micro_batches_an_afd_attention_rank(v2_micro_batches, stages):
    full = CUDAGraphMode.FULL_DECODE_ONLY
    verify_afd_dbo(_config(stages, v2=True, cudagraph_mode=full))
    verify_afd_dbo(_config(stages, v2=True, cudagraph_mode=CUDAGraphMode.NONE))
    verify_afd_dbo(_config(stages, v2=True, model=SimpleNamespace(is_hybrid=False)))


def test_a_model_runner_v2_that_cannot_micro_batch_is_refused(monkeypatch):
    """vLLM 0.26's V2 has no micro-batching: it would run every step whole."""
    monkeypatch.setattr(dbo, "model_runner_v2_micro_batches", lambda: False)
    for config in (_config(2, enable_dbo=True, v2=True), _config(3, v2=True)):
        with pytest.raises(ValueError, match="cannot split a step into micro-batches") as e:
            verify_afd_dbo(config)
        assert "set VLLM_USE_V2_MODEL_RUNNER=0 to micro-batch on Model Runner V1" in str(e.value)
        assert "use vLLM 0.32 or later, or drop --enable-dbo / --ubatch-size" in str(e.value)
    verify_afd_dbo(_config(2, enable_dbo=True))  # Model Runner V1 micro-batches
    verify_afd_dbo(_config(2, v2=True, role="ffn"))  # the FFN role runs its own runner


def test_model_runner_v2_refuses_hybrid_models_under_afd(v2_micro_batches):
    hybrid = SimpleNamespace(is_hybrid=True, architecture="Qwen3NextForCausalLM")
    with pytest.raises(ValueError, match="V2 does not micro-batch hybrid models") as e:
        verify_afd_dbo(_config(2, v2=True, model=hybrid))
    assert "Qwen3NextForCausalLM" in str(e.value) and "drop --enable-dbo" in str(e.value)
    verify_afd_dbo(_config(2, model=hybrid))  # V1: as before


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_model_runner_v2_refuses_piecewise_graphs_under_afd(v2_micro_batches, mode):
    with pytest.raises(ValueError, match="FULL CUDA graphs only") as e:
        verify_afd_dbo(_config(2, v2=True, cudagraph_mode=mode))
    assert f"not cudagraph_mode {mode.name}" in str(e.value)
    assert "-cc.cudagraph_mode=FULL_DECODE_ONLY (or --enforce-eager)" in str(e.value)
