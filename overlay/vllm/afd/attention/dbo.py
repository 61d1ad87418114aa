# SPDX-License-Identifier: Apache-2.0
"""Micro-batch overlap under AFD: each step in several stages (2 by default).

vLLM's micro-batching (``--enable-dbo`` for two stages, ``--ubatch-size N``
for N) splits a step into micro-batches that as many threads run in turn on
one GPU: Model Runner V1's micro-batch wrapper (up to vLLM 0.33), and Model
Runner V2's ``UBatchRunner`` from vLLM 0.30 on. Upstream hides an all2all
behind the other micro-batch's compute, so it asks for data parallelism and
an all2all backend. Under AFD the transfer to hide is the FFN exchange: an
attention rank micro-batches on its own, its remote-FFN op yields to the
other micro-batch between sending and receiving, and the FFN rank runs each
layer's stages in order, so stage 0's rows travel and are computed while the
attention side computes stage 1. The control payload carries every stage's
token counts, and the FFN graph key covers them all.

Each stage is a separate FFN pass, so the FFN reads its weights once per
stage: where the FFN is bound by reading its weights (MoE decode at small
batches), N stages cost it about N times one pass. docs/performance.md
measures where overlap pays.

The patches ask this module whether an attention rank micro-batches, which
needs no data-parallel peers (``afd_micro_batching``: V1's joint decision
and V2's runner and its joint decision, then run for this one rank), where
to split a V1 step (``afd_split_point``), and each stage's token counts for
the payload (``stage_token_counts``; for V2's micro-batched FULL graphs, its
"twins" of the single-stage ones, ``twin_stage_counts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from vllm.afd.runners import model_runner_v2_micro_batches, runs_model_runner_v2
from vllm.distributed.afd_transfer.payload import MAX_STAGES

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.worker.ubatch_utils import UBatchSlices


def verify_afd_dbo(vllm_config: VllmConfig) -> None:
    """Refuse micro-batching layouts AFD does not run."""
    afd, parallel = vllm_config.afd_config, vllm_config.parallel_config
    if afd is None or not parallel.use_ubatching:
        return
    if parallel.enable_dbo and parallel.ubatch_size > 2:
        raise ValueError(
            f"--enable-dbo runs 2 stages, but ubatch_size={parallel.ubatch_size} asks for "
            f"{parallel.ubatch_size}; pass one of them: --enable-dbo (2 stages) or "
            "--ubatch-size N (N stages)"
        )
    if parallel.num_ubatches > MAX_STAGES:
        raise ValueError(
            f"AFD runs at most {MAX_STAGES} overlap stages, but ubatch_size="
            f"{parallel.ubatch_size} asks for {parallel.num_ubatches}"
        )
    if parallel.tensor_parallel_size > 1:
        raise ValueError(
            "AFD with dual-batch overlap runs on attention ranks of one device: with "
            f"tensor_parallel_size={parallel.tensor_parallel_size} drop --enable-dbo"
        )
    if afd.num_attention_ranks != afd.num_ffn_ranks:
        raise ValueError(
            "AFD with dual-batch overlap needs one attention rank per FFN rank "
            f"(num_attention_ranks == num_ffn_ranks), got {afd.num_attention_ranks}A"
            f"{afd.num_ffn_ranks}F; drop --enable-dbo or change the topology"
        )
    # The FFN role runs its own runner (vllm.afd.ffn); only the attention
    # role's runner splits steps.
    if afd.role == "attention" and runs_model_runner_v2(vllm_config):
        verify_v2_micro_batching(vllm_config)


def verify_v2_micro_batching(vllm_config: VllmConfig) -> None:
    """Refuse what Model Runner V2 does not micro-batch, before vLLM runs
    single-stage steps instead (vLLM 0.26) or refuses it with its own words."""
    drop = "drop --enable-dbo / --ubatch-size"
    if not model_runner_v2_micro_batches():
        # vLLM 0.26: V1 is there (vLLM removed it only after V2 micro-batched).
        raise ValueError(
            "AFD micro-batch overlap (--enable-dbo, --ubatch-size) would run on Model Runner "
            "V2, which cannot split a step into micro-batches in this vLLM (V2 micro-batches "
            "from vLLM 0.30 on; here it would run every step whole): set "
            "VLLM_USE_V2_MODEL_RUNNER=0 to micro-batch on Model Runner V1, use vLLM 0.32 or "
            f"later, or {drop}"
        )
    model = vllm_config.model_config
    if model is not None and model.is_hybrid:
        raise ValueError(
            f"AFD micro-batch overlap on Model Runner V2: V2 does not micro-batch hybrid "
            f"models ({model.architecture} keeps a recurrent state beside its attention); "
            f"{drop}"
        )
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.has_piecewise_cudagraphs():
        raise ValueError(
            f"AFD micro-batch overlap on Model Runner V2: V2 micro-batches with FULL CUDA "
            f"graphs only, not cudagraph_mode {mode.name}; pass "
            "-cc.cudagraph_mode=FULL_DECODE_ONLY (or --enforce-eager), or "
            f"{drop}"
        )


def afd_micro_batching(parallel_config: ParallelConfig | None) -> bool:
    """Whether this process is an AFD attention rank that micro-batches: it
    needs neither data-parallel peers nor an all2all backend to do so. V2's
    callers that never micro-batch pass no config (None: no)."""
    # every step asks: answer without DBO at once
    if parallel_config is None or not parallel_config.use_ubatching:
        return False
    from vllm.distributed.afd_transfer.afd_transfer_state import get_attention_endpoint

    return get_attention_endpoint() is not None


def request_boundary_split(
    num_scheduled_tokens: np.ndarray, num_tokens_padded: int, num_stages: int = 2
) -> int | None:
    """The token index at which to split a step into two stages: the
    request boundary nearest the middle, so no request straddles the stages
    where the batch allows it. None keeps vLLM's own split (the middle of
    the padded batch) when that already falls on a boundary (every decode
    batch, so the layouts of captured graphs stay as vLLM captured them) or
    when the batch has a single request. vLLM 0.26's slicer takes a single
    split point and repeats it, so with more than two stages it is vLLM's
    even split (None) as well."""
    if num_stages != 2:
        return None
    middle = num_tokens_padded // num_stages
    boundaries = np.cumsum(num_scheduled_tokens)[:-1]
    if len(boundaries) == 0 or middle in boundaries:
        return None
    return int(boundaries[np.argmin(np.abs(boundaries - middle))])


def afd_split_point(
    parallel_config: ParallelConfig, num_scheduled_tokens: np.ndarray, num_tokens_padded: int
) -> int | None:
    """The split point for vLLM's micro-batch slicing: None (vLLM's own)
    unless this is an AFD attention rank."""
    if not afd_micro_batching(parallel_config):
        return None
    return request_boundary_split(
        num_scheduled_tokens, num_tokens_padded, parallel_config.num_ubatches
    )


def stage_token_counts(ubatch_slices: UBatchSlices) -> tuple[tuple[int], ...]:
    """Each stage's token count (padded, as the stages run) for the one
    attention peer of this rank's FFN rank."""
    return tuple((s.num_tokens,) for s in ubatch_slices)


def twin_stage_counts(num_tokens: int, num_stages: int) -> tuple[int, ...]:
    """Each stage's token count in Model Runner V2's micro-batched FULL graph
    of ``num_tokens`` tokens (the "twin" V2 captures beside the single-stage
    graph of a decode size): V2 splits its dummy batch as it splits every
    micro-batched step, at ``num_tokens // num_stages`` tokens a stage, the
    last stage taking the rest. One stage: ``(num_tokens,)``. The capture
    hooks check this against the stages V2 actually ran, so the replays that
    announce it carry the layout of the graph they replay."""
    if num_stages <= 1:
        return (num_tokens,)
    split = num_tokens // num_stages
    return (split,) * (num_stages - 1) + (num_tokens - split * (num_stages - 1),)
