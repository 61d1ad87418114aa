"""A tensor-parallel attention rank on CPU: two TP workers (vLLM's CPU backend
runs TP), one FFN rank on one device.

Only TP rank 0 exchanges hidden states with the FFN rank; TP rank 1 gets
the FFN output through the TP all-reduce. If TP rank 1 got anything else,
its share of the next layer's attention would be wrong and, through that
layer's all-reduce, every rank's tokens. Greedy tokens must equal stock
colocated vLLM run with the same tensor_parallel_size (float32, chunked
prefill mixed with decode, generated checkpoints). The negative control
serves the same attention side from an FFN rank with one layer's MLP zeroed.
"""

from __future__ import annotations

import pytest

from vllm_afd_dev.harness.generate import PROMPTS, afd_engine_args, run
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    zeroed_ffn_rank,
)

TP2 = {"tensor_parallel_size": 2}
# compute_gate_on_attention: the router gate runs on every TP rank, the
# experts on the FFN rank.
CASES = {"qwen3": {}, "qwen3_moe": {"compute_gate_on_attention": True}}


@pytest.fixture(scope="module")
def stock_tp2():
    cache: dict = {}

    def result(model):
        if model not in cache:
            cache[model] = run(model, TP2, stock=True)
        return cache[model]

    return result


@pytest.mark.parametrize("arch", CASES)
def test_tensor_parallel_attention_matches_colocated(arch, request, stock_tp2):
    model = request.getfixturevalue(f"tiny_{arch}")
    afd = run(model, afd_engine_args(TP2, **CASES[arch]))
    stock = stock_tp2(model)
    # Both TP workers hold remote stand-ins, and no FFN weights but router gates.
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert all(
        name.endswith(".gate.weight") for p in afd["placements"] for name in p["local_mlp_params"]
    )
    assert len(stock["placements"]) == 2 and stock["remote_ffn_layers"] == 0
    assert len(afd["tokens"]) == len(PROMPTS)
    assert afd["tokens"] == stock["tokens"]
    # One TP rank connected, and the FFN rank served it to the end.
    log = afd["log"]
    assert log.count("AFD attention rank 0 connected") == 1, failure_report(log)
    assert "AFD FFN rank 0: shutdown after" in log, failure_report(log)


def test_negative_control_tp2_with_a_zeroed_ffn_rank(tiny_qwen3, stock_tp2, tmp_path):
    with zeroed_ffn_rank(tiny_qwen3, tmp_path) as port:
        broken = run(tiny_qwen3, attention_args(port, engine=TP2))
    assert_every_prompt_changed(broken["tokens"], stock_tp2(tiny_qwen3)["tokens"])
