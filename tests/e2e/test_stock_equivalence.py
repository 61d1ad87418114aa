"""With no afd_config, the patched vLLM generates exactly what stock vLLM does.

Greedy decoding on the built-in tiny model, float32, prompts of mixed lengths
with a 32-token step budget (chunked prefill mixed with decode). Stock vLLM is
imported from the pristine tree of the pinned wheel, in its own process.
"""

from __future__ import annotations

import pytest

from vllm_afd_dev.harness.generate import PROMPTS, run
from vllm_afd_dev.models.tiny_model import with_zeroed_mlp


@pytest.fixture(scope="module")
def patched(tiny_qwen3):
    return run(tiny_qwen3)


def test_patched_matches_stock(patched, tiny_qwen3, pristine_cpu, colocated):
    stock = colocated(tiny_qwen3)
    assert not patched["vllm"].startswith(str(pristine_cpu))
    assert len(patched["tokens"]) == len(PROMPTS)
    assert all(len(t) == 24 for t in patched["tokens"])
    assert patched["tokens"] == stock["tokens"]


def test_negative_control_zeroed_ffn_changes_tokens(patched, tiny_qwen3, tmp_path):
    """The comparison can fail: one layer's MLP zeroed changes every prompt."""
    broken = run(with_zeroed_mlp(tiny_qwen3, tmp_path / "zeroed", layer=1))
    changed = [a != b for a, b in zip(patched["tokens"], broken["tokens"], strict=True)]
    assert all(changed), changed
