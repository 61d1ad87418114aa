"""Per-peer token counts that the attention side puts in each payload."""

from __future__ import annotations

import pytest
import torch
from vllm.afd.attention.step_hooks import peer_token_counts
from vllm.forward_context import DPMetadata


def test_one_peer_sends_its_own_count():
    assert peer_token_counts([3], 7, None) == (7,)


def test_several_peers_take_their_counts_from_the_dp_ranks():
    dp = DPMetadata(torch.tensor([5, 1, 9, 2], dtype=torch.int32))
    assert peer_token_counts([0, 1], 5, dp) == (5, 1)
    assert peer_token_counts([2, 3], 9, dp) == (9, 2)


def test_several_peers_without_dp_counts_is_a_clear_error():
    with pytest.raises(RuntimeError, match="data_parallel_size = num_attention_ranks"):
        peer_token_counts([0, 1], 5, None)
