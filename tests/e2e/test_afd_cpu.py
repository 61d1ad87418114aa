"""AFD 1A1F on CPU: real attention and FFN processes over the gloo connector.

Greedy outputs must equal stock colocated vLLM token for token (float32,
prompts of mixed lengths, a 32-token step budget so that chunked prefill and
decode share steps) on the generated random-weight checkpoints. The negative
control runs the same attention side against an FFN rank whose checkpoint
has one layer's MLP zeroed. Failure tests: a killed FFN rank, a mismatched
model, a missing FFN rank; each must end with a clear error in bounded time.
"""

from __future__ import annotations

import re
import time

import pytest
from vllm.distributed.afd_transfer.step_stats import StepRecord

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    GenerationError,
    afd_engine_args,
    free_port,
    run,
)
from vllm_afd_dev.harness.launch import (
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    ffn_server,
    kill_ffn_mid_generation,
    zeroed_ffn_rank,
)
from vllm_afd_dev.models.tiny_model import with_num_layers


@pytest.mark.parametrize("arch", [pytest.param("qwen3", marks=pytest.mark.every_release), "llama"])
def test_afd_1a1f_matches_colocated(arch, request, colocated, tmp_path):
    model = request.getfixturevalue(f"tiny_{arch}")
    # Step timing on: it must not change a token, and its figures are checked below.
    # One of the runs proves a shared secret on every connection (spawn_ffn
    # passes the file to its FFN rank).
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    afd_args = {"secret_file": str(secret)} if arch == "llama" else {}
    stats = tmp_path / "stats"
    afd = run(model, afd_engine_args(time_steps=True, stats_dir=str(stats), **afd_args))
    stock = colocated(model)
    assert len(afd["tokens"]) == len(PROMPTS)
    assert all(len(t) == 24 for t in afd["tokens"])
    # The attention engine holds no MLP weights: every layer's FFN is remote.
    assert afd["remote_ffn_layers"] == 2 and afd["local_mlp_params"] == []
    assert stock["remote_ffn_layers"] == 0 and stock["local_mlp_params"] != []
    assert afd["tokens"] == stock["tokens"]
    check_step_times(stats)


def check_step_times(stats_dir) -> None:
    """Both roles timed the same real steps, and the times add up. The roles
    run in series, so the FFN's compute lies inside the attention step it
    serves, and the attention side's exchange (waiting in its recv) holds most
    of it. Not all: on a busy host the attention process may be descheduled
    between its send and its recv, which counts as its compute; so that check
    is made over the whole run, not per step."""
    attention = {t.layout: t for t in StepRecord.read(stats_dir, "attention rank 0").step_times}
    ffn = {t.layout: t for t in StepRecord.read(stats_dir, "FFN rank 0").step_times}
    assert attention and attention.keys() == ffn.keys(), (attention, ffn)
    for layout, a in attention.items():
        f = ffn[layout]
        assert a.steps == f.steps and a.kind == f.kind == "eager"
        assert a.compute_ms > 0 and f.compute_ms > 0
        assert a.compute_ms + a.exchange_ms >= f.compute_ms, (layout, a, f)
    held = sum(a.exchange_ms * a.steps for a in attention.values())
    ffn_compute = sum(f.compute_ms * f.steps for f in ffn.values())
    assert held >= 0.5 * ffn_compute, (attention, ffn)


def test_negative_control_zeroed_ffn_rank_changes_tokens(tiny_qwen3, colocated, tmp_path):
    """The comparison can fail: the FFN rank's layer-1 MLP outputs zero."""
    with zeroed_ffn_rank(tiny_qwen3, tmp_path) as port:
        broken = run(tiny_qwen3, attention_args(port))
    assert "AFD FFN rank 0: shutdown after" in (tmp_path / "ffn.log").read_text()
    assert_every_prompt_changed(broken["tokens"], colocated(tiny_qwen3)["tokens"])


def test_a_first_forward_past_timeout_s_ends_in_a_working_deployment(tiny_qwen3):
    """A cold torch.compile inside the attention side's first forward keeps
    the FFN rank waiting on its transfers far longer than ``timeout_s``; a
    peer that lives is waited for, so the deployment serves, token for token."""
    timeout_s = 5  # real steps under a loaded CI machine's two test workers took over 2 s
    compiled = {"enforce_eager": False}
    cold = {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    afd = run(tiny_qwen3, afd_engine_args(compiled, timeout_s=timeout_s), env=cold)
    # vLLM's CPU runner compiles in its warm-up forwards, which the FFN rank mirrors.
    took = re.search(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", afd["log"]
    )
    assert took and float(took.group(1)) > 2 * timeout_s, failure_report(afd["log"])
    assert afd["tokens"] == run(tiny_qwen3, compiled, stock=True, env=cold)["tokens"]


def test_killing_the_ffn_rank_fails_the_attention_side_in_time(tiny_qwen3, tmp_path):
    port, timeout_s = free_port(), 30
    ffn = ffn_server(tiny_qwen3, port, tmp_path / "ffn.log")
    out = tmp_path / "out.json"
    code, elapsed, log = kill_ffn_mid_generation(
        tiny_qwen3, attention_args(port, timeout_s), ffn, out, timeout_s + 60
    )
    assert code != 0 and not out.exists()
    lost = f"AFD attention rank 0: lost the FFN rank at 127.0.0.1:{port}"
    assert lost in log, failure_report(log)
    print(f"attention side exited {elapsed:.1f} s after the FFN rank was killed")
    assert elapsed < timeout_s + 30, elapsed  # the error itself, plus engine teardown


def test_mismatched_model_is_reported_on_both_sides(tiny_qwen3, tmp_path):
    port = free_port()
    one_layer = with_num_layers(tiny_qwen3, tmp_path / "one-layer", 1)
    ffn = ffn_server(one_layer, port, tmp_path / "ffn.log")
    try:
        with pytest.raises(GenerationError) as failure:
            run(tiny_qwen3, attention_args(port), timeout_s=400)
        ffn_code = ffn.wait(timeout=60)
    finally:
        ffn.kill()
    expected = "num_layers: ffn=1, attention rank 0=2"
    assert f"AFD handshake with the FFN rank at 127.0.0.1:{port} failed" in failure.value.output
    assert "num_layers: attention rank 0=2, ffn=1" in failure.value.output
    ffn_log = (tmp_path / "ffn.log").read_text()
    assert ffn_code != 0 and expected in ffn_log, failure_report(ffn_log)


def test_missing_ffn_rank_is_named_within_the_timeout(tiny_qwen3):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(GenerationError) as failure:
        run(tiny_qwen3, attention_args(port, startup_timeout_s=5), timeout_s=300)
    assert f"no FFN rank answered at 127.0.0.1:{port} within 5 s" in failure.value.output
    assert "vllm afd-ffn" in failure.value.output
    assert time.monotonic() - start < 120
