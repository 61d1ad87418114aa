"""Failover in place on the gloo connector, where a redo would not be the
same forward (``failover.redo_limits``): a hybrid model, whose recurrent
state each forward updates in place, and a tensor-parallel attention rank,
whose other TP rank waits in the TP all-reduce.

The FFN rank is SIGKILLed (the hybrid model's first time in the first
steps, which prefill the prompts in chunks, then mid-decode); the attention
rank's failed transfer waits for a replacement (a respawn), which resumes
the step at the layer where the exchange stood, and every sequence equals
stock colocated vLLM's, token for token. In the negative control the
replacement, started by hand, serves a checkpoint with a zeroed layer: the
sequences in flight then differ from stock's, so the comparison sees the
tokens computed after the failover.
"""

from __future__ import annotations

import functools
import re
import signal
import time

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    afd_engine_args,
    failure_report,
    free_port,
    run,
    spawned_ffn_processes,
)
from vllm_afd_dev.harness.launch import TOOK_OVER, ffn_server, generate_killing_ffn_ranks
from vllm_afd_dev.models.tiny_model import with_zeroed_mlp

HYBRID = dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32")
"""Qwen3-Next on vLLM's CPU backend (its GDN kernels need bfloat16)."""
TP2 = {"tensor_parallel_size": 2}
MAX_TOKENS = 160
"""Long enough for two kills and their respawns inside one generation."""
FAILOVER_S = 240
RESUMED_IN_PLACE = re.compile(re.escape(TOOK_OVER) + r" [\d.]+ s \(failover \d+\); "
                              r"it resumes at step (\d+), layer (\d+)")  # fmt: skip
RESUMED_ROWS = re.compile(r"resumes step \d+ \(rows by stage \(\((\d+),\),\)\)")
"""The replacement's log line for the step it resumes: that step's rows."""


@functools.cache
def stock(model, engine: tuple) -> list:
    return run(model, dict(engine), stock=True, max_tokens=MAX_TOKENS)["tokens"]


def killed_and_resumed(
    model, engine: dict, kills: int, after_s: float | tuple[float, ...] = 0.2
) -> tuple[list, list, str]:
    """The tokens, the (step, layer) of each resume in place and the log of
    a generation whose spawned FFN rank is SIGKILLed ``kills`` times
    (``generate_killing_ffn_ranks``'s ``after_s``)."""
    args = afd_engine_args(engine, failover_timeout_s=FAILOVER_S)
    port = args["afd_config"]["port"]

    def kill() -> None:
        [ffn] = spawned_ffn_processes(port)
        ffn.send_signal(signal.SIGKILL)

    afd = generate_killing_ffn_ranks(model, args, kill, kills=kills, max_tokens=MAX_TOKENS,
                                     timeout_s=900, after_s=after_s)  # fmt: skip
    resumed = RESUMED_IN_PLACE.findall(afd["log"])
    print(f"resumed in place at (step, layer) {resumed}")
    return afd["tokens"], resumed, afd["log"]


def test_a_hybrid_model_resumes_in_place_when_its_ffn_rank_is_killed_twice(tiny_qwen3_next):
    """The first kill at once, in a step that prefills chunks of prompts
    (more rows than sequences); the second mid-decode (a row a sequence)."""
    tokens, resumed, log = killed_and_resumed(tiny_qwen3_next, HYBRID, kills=2, after_s=(0, 3.0))
    rows = [int(r) for r in RESUMED_ROWS.findall(log)]
    assert len(resumed) == 2 and len(rows) == 2, failure_report(log)
    assert rows[0] > len(PROMPTS) and rows[1] == len(PROMPTS), (
        f"the kills landed in steps of {rows} rows, not in a prefill step and then a decode "
        f"step of {len(PROMPTS)} sequences: change after_s\n{failure_report(log)}"
    )
    assert tokens == stock(tiny_qwen3_next, tuple(HYBRID.items())), failure_report(log)


def test_a_tensor_parallel_attention_rank_resumes_in_place(tiny_qwen3):
    tokens, resumed, log = killed_and_resumed(tiny_qwen3, TP2, kills=1)
    assert len(resumed) == 1, failure_report(log)
    assert tokens == stock(tiny_qwen3, tuple(TP2.items())), failure_report(log)


def test_negative_control_a_zeroed_replacement_changes_the_sequences_in_flight(
    tiny_qwen3_next, tmp_path
):
    port = free_port()
    engine = ("--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--enforce-eager")
    logs = [tmp_path / "ffn.log", tmp_path / "zeroed-ffn.log"]
    first = ffn_server(tiny_qwen3_next, port, logs[0], engine=engine)
    replacement = None
    broken = with_zeroed_mlp(tiny_qwen3_next, tmp_path / "zeroed", layer=1)

    def replace_with_the_zeroed_checkpoint() -> None:
        nonlocal replacement
        first.kill()
        first.wait(timeout=30)
        time.sleep(0.5)  # the attention rank's transfer fails first
        replacement = ffn_server(broken, port, logs[1], engine=engine)

    args = afd_engine_args(HYBRID, spawn_ffn=False, port=port, failover_timeout_s=FAILOVER_S)
    try:
        afd = generate_killing_ffn_ranks(tiny_qwen3_next, args, replace_with_the_zeroed_checkpoint,
                                         kills=1, max_tokens=MAX_TOKENS, timeout_s=900)  # fmt: skip
    finally:
        for proc in (first, replacement):
            if proc is not None:
                proc.kill()
    log = afd["log"] + "".join(f"\n== {f.name}\n{f.read_text()}" for f in logs if f.exists())
    assert len(RESUMED_IN_PLACE.findall(log)) == 1, failure_report(log)
    reference = stock(tiny_qwen3_next, tuple(HYBRID.items()))
    changed = [
        i
        for i, (ours, theirs) in enumerate(zip(afd["tokens"], reference, strict=True))
        if ours != theirs
    ]
    assert changed, failure_report(log)
