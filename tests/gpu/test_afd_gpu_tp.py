"""A tensor-parallel attention rank (TP 2) served by one FFN rank. Only TP
rank 0 exchanges hidden states with it; TP rank 1 gets the FFN output
through vLLM's TP all-reduce, which FULL_DECODE_ONLY captures in the
attention side's graphs.

On two GPUs: TP ranks on GPUs 0 and 1, the FFN rank on GPU 1, over ipc (peer
access) or nccl, against stock vLLM at tensor_parallel_size 2.

On one GPU (a test placement, ``run_tp_ranks_on_one_gpu``): both TP ranks and
the FFN rank on GPU 0, over ipc; each TP rank is its own engine process,
started as vLLM's ``external_launcher`` backend expects, and so is stock
vLLM's TP 2 reference.

Greedy tokens must equal stock vLLM at TP 2. The FFN rank computes each MLP
whole while stock TP2 sums two shards of it, so the two differ in the order
of one reduction: the runs use float32 (TRITON_ATTN), where that difference
stays far below the greedy margin; bf16 equality needs a tensor-parallel FFN
rank with the same shards (tests/gpu/test_afd_gpu_ffn_group.py).
"""

from __future__ import annotations

import functools
import signal
import threading
import time

import pytest

from vllm_afd_dev.harness.generate import afd_engine_args, free_port, run, spawned_ffn_processes
from vllm_afd_dev.harness.gpu_settings import (
    EAGER_AND_GRAPHS,
    check_step_counters,
    engine,
    ffn_cli_args,
    placement_env,
    two_gpus,
)
from vllm_afd_dev.harness.launch import (
    TOOK_OVER,
    assert_every_prompt_changed,
    attention_args,
    failure_report,
    ffn_server,
    generate_killing_ffn_ranks,
    run_tp_ranks_on_one_gpu,
    running_ffn_rank,
    zeroed_ffn_rank,
)
from vllm_afd_dev.models.tiny_model import with_zeroed_mlp

ONE_GPU = placement_env("ipc-1gpu")

FAILOVER_TOKENS = 1500
"""Seconds of decoding: the kill comes 0.2 s after tokens flow."""
FLOAT32_TP2 = dict(dtype="float32", attention_backend="TRITON_ATTN", tensor_parallel_size=2)


def tp2_engine(setting: str) -> dict:
    return engine(setting) | FLOAT32_TP2


def failover_tp2_engine() -> dict:
    """FULL_DECODE_ONLY at TP 2, long enough for ``FAILOVER_TOKENS``."""
    return dict(tp2_engine("FULL_DECODE_ONLY"), max_model_len=2048)


@functools.cache
def stock_tp2(model, setting: str) -> dict:
    return run(model, tp2_engine(setting), stock=True)


@two_gpus
@pytest.mark.parametrize("connector", ["ipc", "nccl"])
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_tp2_attention_matches_stock_tp2(setting, connector, tiny_qwen3, tmp_path):
    args = afd_engine_args(tp2_engine(setting), connector=connector, stats_dir=str(tmp_path))
    afd = run(tiny_qwen3, args)
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert afd["tokens"] == stock_tp2(tiny_qwen3, setting)["tokens"]
    assert afd["log"].count("AFD attention rank 0 connected") == 1
    check_step_counters(tmp_path, setting)


@two_gpus
def test_negative_control_tp2_with_a_zeroed_ffn_rank(tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    ffn_args = ffn_cli_args(setting, dtype="float32")
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, engine=ffn_args, connector="nccl") as port:
        broken = run(tiny_qwen3, attention_args(port, engine=tp2_engine(setting), connector="nccl"))
    assert_every_prompt_changed(broken["tokens"], stock_tp2(tiny_qwen3, setting)["tokens"])


@two_gpus
def test_tp2_attention_resumes_in_place_when_its_ffn_rank_is_killed(tiny_qwen3):
    """Failover (ipc): TP rank 0's forward stays blocked on the lost FFN
    rank's flags and TP rank 1's in the TP all-reduce, where no error
    reaches it; the replacement answers from the layer the flags name, so
    both resume the same forward, and the tokens equal stock TP 2's."""
    long_run = failover_tp2_engine()
    args = afd_engine_args(long_run, connector="ipc", failover_timeout_s=90)
    port = args["afd_config"]["port"]

    def kill_spawned() -> None:
        [ffn] = spawned_ffn_processes(port)
        ffn.send_signal(signal.SIGKILL)

    afd = generate_killing_ffn_ranks(tiny_qwen3, args, kill_spawned, kills=1,
                                     max_tokens=FAILOVER_TOKENS, timeout_s=400)  # fmt: skip
    assert afd["log"].count(TOOK_OVER) == 1, failure_report(afd["log"])
    stock = run(tiny_qwen3, long_run, stock=True, max_tokens=FAILOVER_TOKENS)
    assert afd["tokens"] == stock["tokens"], failure_report(afd["log"])


@functools.cache
def stock_tp2_on_one_gpu(model, setting: str) -> dict:
    return run_tp_ranks_on_one_gpu(model, tp2_engine(setting), stock=True, env=ONE_GPU)


def one_gpu_ffn_rank(setting: str, **afd) -> dict:
    return dict(engine=ffn_cli_args(setting, dtype="float32"), env=ONE_GPU, connector="ipc", **afd)


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
def test_tp2_attention_sharing_one_gpu_matches_stock_tp2(setting, tiny_qwen3, tmp_path):
    stats = {"stats_dir": str(tmp_path)}
    with running_ffn_rank(tiny_qwen3, tmp_path, **one_gpu_ffn_rank(setting, **stats)) as (
        port,
        log,
    ):
        attention = attention_args(port, engine=tp2_engine(setting), connector="ipc", **stats)
        afd = run_tp_ranks_on_one_gpu(tiny_qwen3, attention, env=ONE_GPU)
    assert [p["remote_ffn_layers"] for p in afd["placements"]] == [2, 2]
    assert afd["tokens"] == stock_tp2_on_one_gpu(tiny_qwen3, setting)["tokens"]
    ffn_log = log.read_text()
    assert ffn_log.count("attention rank 0 connected") == 1
    check_step_counters(tmp_path, setting)


def test_negative_control_tp2_sharing_one_gpu_with_a_zeroed_ffn_rank(tiny_qwen3, tmp_path):
    setting = "FULL_DECODE_ONLY"
    with zeroed_ffn_rank(tiny_qwen3, tmp_path, **one_gpu_ffn_rank(setting)) as port:
        attention = attention_args(port, engine=tp2_engine(setting), connector="ipc")
        broken = run_tp_ranks_on_one_gpu(tiny_qwen3, attention, env=ONE_GPU)
    reference = stock_tp2_on_one_gpu(tiny_qwen3, setting)["tokens"]
    assert_every_prompt_changed(broken["tokens"], reference)


@functools.cache
def stock_tp2_long_run_on_one_gpu(model) -> list:
    result = run_tp_ranks_on_one_gpu(model, failover_tp2_engine(), stock=True, env=ONE_GPU,
                                     max_tokens=FAILOVER_TOKENS)  # fmt: skip
    return result["tokens"]


@pytest.mark.parametrize("replacement", ["same", "zeroed_layer"])
def test_tp2_attention_sharing_one_gpu_resumes_in_place_when_its_ffn_rank_is_killed(
    tiny_qwen3, tmp_path, replacement
):
    """Failover (ipc) as in the two-GPU test above, every process on one GPU:
    the FFN rank, started by hand, is SIGKILLed once tokens flow, and a
    replacement started by hand at its port takes its place. TP rank 0's
    forward resumes from the layer its flags name while TP rank 1 waits in
    the all-reduce: the tokens equal stock TP 2's. A replacement with layer
    1's MLP zeroed (the negative control) changes every sequence."""
    ffn = one_gpu_ffn_rank("FULL_DECODE_ONLY")
    port = free_port()
    logs = [tmp_path / "ffn-0.log", tmp_path / "ffn-1.log"]
    attention = attention_args(port, engine=failover_tp2_engine(), connector="ipc",
                               failover_timeout_s=90)  # fmt: skip
    outcome: dict = {}

    def generate() -> None:
        try:
            outcome["afd"] = run_tp_ranks_on_one_gpu(tiny_qwen3, attention, env=ONE_GPU,
                                                     max_tokens=FAILOVER_TOKENS,
                                                     timeout_s=600, workdir=tmp_path)  # fmt: skip
        except Exception as error:  # reported below, from the test's thread
            outcome["error"] = error

    def report() -> str:
        return failure_report("".join(f"\n== {f.name}\n{f.read_text()}"
                                      for f in sorted(tmp_path.glob("*.log"))))  # fmt: skip

    checkpoint = tiny_qwen3
    if replacement == "zeroed_layer":
        checkpoint = with_zeroed_mlp(tiny_qwen3, tmp_path / "zeroed", layer=1)
    procs = [ffn_server(tiny_qwen3, port, logs[0], **ffn)]
    ranks = threading.Thread(target=generate, daemon=True)
    try:
        ranks.start()
        rank0 = tmp_path / "rank0.log"
        deadline = time.monotonic() + 600
        while not (rank0.is_file() and "generating " in rank0.read_text()):
            assert ranks.is_alive() and time.monotonic() < deadline, report()
            time.sleep(0.05)
        time.sleep(0.2)  # mid-generation
        assert ranks.is_alive(), "generation ended before the kill"
        procs[0].send_signal(signal.SIGKILL)
        procs.append(ffn_server(checkpoint, port, logs[1], **ffn))
        ranks.join(timeout=660)
        assert not ranks.is_alive(), report()
        assert "error" not in outcome, f"{outcome.get('error')}\n{report()}"
        assert procs[1].wait(timeout=60) == 0, report()
    finally:
        for proc in procs:
            proc.kill()
    afd = outcome["afd"]
    assert afd["log"].count(TOOK_OVER) == 1, report()
    assert "resumes step" in logs[1].read_text(), report()
    reference = stock_tp2_long_run_on_one_gpu(tiny_qwen3)
    if replacement == "same":
        assert afd["tokens"] == reference, report()
    else:
        assert_every_prompt_changed(afd["tokens"], reference)
