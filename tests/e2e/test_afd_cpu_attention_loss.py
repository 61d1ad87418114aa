"""A lost attention rank ends none of the FFN rank's other peers.

2A1F on CPU (gloo) with the two attention ranks as deployments of their own
(``attention_rank``, one process each, data_parallel_size 1) sharing one
hand-started FFN rank with ``failover_timeout_s``. Attention rank 0 is
SIGKILLed mid-decode: the FFN rank drops it and serves rank 1 on, whose
greedy tokens must equal stock colocated vLLM's; then rank 0, restarted,
joins its FFN rank again through the same handshake, at its place, with no
restart of the others, and its tokens must equal stock's too. Under
`vllm serve` (one server per attention rank, 16 streaming requests each),
rank 0's engine is killed: its server fails its requests back to their
clients, and rank 1's answers equal stock's.

vLLM 0.26.0's own data-parallel front end ends every engine when one dies
(``CoreEngineProcManager.monitor_engine_liveness``: "Any engine exit
currently triggers a shutdown"), and its DP engines' collectives fail with
a lost peer, so attention ranks that must outlive each other cannot be the
DP ranks of one deployment (``test_afd_cpu_dp.py``,
``test_a_killed_attention_rank_ends_the_deployment``: that shape still ends).

A wrong FFN answer changes the tokens: the negative control of this
comparison (AFD 2A1F tokens against stock's, through a zeroed FFN rank) is
``test_afd_cpu_dp.py::test_negative_control_2a1f_with_a_zeroed_ffn_rank``.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    failure_report,
    free_port,
    rank_results,
    run,
)
from vllm_afd_dev.harness.launch import (
    SERVE_ENGINE,
    StreamingCompletions,
    ffn_server,
    kill_engine,
    serve,
    start_attention_rank_of_its_own,
    stop,
    wait_for_log,
    wait_for_ranks,
    wait_until_healthy,
)

SHARES = {0: [0, 1, 2], 1: [3, 4, 5]}
MAX_TOKENS, RESTARTED_TOKENS = 256, 48
"""Both ranks start decoding together (a go file) and decode long enough
(about 3 s at 12 ms a step on 2 cores) for the kill to come mid-decode and
rank 1 to run on well past it; the restarted rank decodes less. Greedy
tokens of fewer steps are a prefix of more, so one stock run serves both."""
DROPPED = "dropped, serving attention ranks [1] on"
TIMEOUT_S = 180


def test_a_killed_attention_rank_of_its_own_ends_none_of_the_others_and_rejoins(
    tiny_qwen3, tmp_path
):
    # The stock reference runs while the AFD processes start.
    stock = ThreadPoolExecutor(1).submit(run, tiny_qwen3, stock=True, max_tokens=MAX_TOKENS)
    port, ffn_log, go = free_port(), tmp_path / "ffn.log", tmp_path / "go"
    topology = {"num_attention_ranks": 2}
    ffn = ffn_server(tiny_qwen3, port, ffn_log, failover_timeout_s=120, **topology)
    ranks = {
        r: start_attention_rank_of_its_own(
            tiny_qwen3, port, r, SHARES[r], MAX_TOKENS, tmp_path / f"rank{r}", go, **topology
        )
        for r in (0, 1)
    }
    restarted = None
    logs = [ffn_log] + [log for _, _, log in ranks.values()]

    def report() -> str:
        return failure_report(
            "".join(f"\n== {log.name}\n{log.read_text()}" for log in logs if log.exists())
        )

    try:
        for proc, _, log in ranks.values():
            wait_for_log(proc, log, "ready to generate", report)
        go.touch()
        time.sleep(1)  # mid-decode
        victim, survivor = ranks[0], ranks[1]
        for proc, result, _ in (victim, survivor):
            assert proc.poll() is None and not result.exists(), "done before the kill" + report()
        victim[0].send_signal(signal.SIGKILL)
        wait_for_log(ffn, ffn_log, DROPPED, report, timeout_s=60)
        # The same command again: it joins at its place, rank 1 untouched.
        restarted = start_attention_rank_of_its_own(
            tiny_qwen3, port, 0, SHARES[0], RESTARTED_TOKENS, tmp_path / "rank0-again", **topology
        )
        logs.append(restarted[2])
        wait_for_ranks([survivor[0], restarted[0]], TIMEOUT_S)
        (survived, rejoined), _ = rank_results([survivor, restarted], "attention rank")
        assert ffn.wait(timeout=60) == 0, report()  # every place finished
        reference = stock.result(timeout=TIMEOUT_S)["tokens"]
    finally:
        for proc in (ffn, *(p for p, _, _ in ranks.values()), *(restarted or ())[:1]):
            proc.kill()
    text = ffn_log.read_text()
    assert survived["tokens"] == [reference[i] for i in SHARES[1]], report()
    assert rejoined["tokens"] == [reference[i][:RESTARTED_TOKENS] for i in SHARES[0]], report()
    assert f"AFD FFN rank on 127.0.0.1:{port}: attention rank 0 joined again" in text, report()
    assert "AFD FFN rank 0: shutdown after" in text, report()


STREAMS_PER_RANK = 16


def test_a_killed_engine_under_vllm_serve_fails_its_requests_and_the_other_serves_on(
    tiny_qwen3, colocated, tmp_path
):
    """2A1F, each attention rank a `vllm serve` of its own, 32 streaming
    requests in all; rank 0's engine is SIGKILLed mid-run."""
    reference = colocated(tiny_qwen3)["tokens"]
    afd_port, ffn_log = free_port(), tmp_path / "ffn.log"
    topology = {"num_attention_ranks": 2}
    ffn = ffn_server(tiny_qwen3, afd_port, ffn_log, failover_timeout_s=120, **topology)
    ports = {r: free_port() for r in (0, 1)}
    logs = {r: tmp_path / f"serve{r}.log" for r in (0, 1)}
    servers = {
        r: serve(tiny_qwen3, ports[r], logs[r], *SERVE_ENGINE, "--afd-config",
                 json.dumps({"port": afd_port, "attention_rank": r, **topology}))
        for r in (0, 1)
    }  # fmt: skip
    prompts = [i % len(PROMPTS) for i in range(STREAMS_PER_RANK)]

    def report() -> str:
        return failure_report("".join(f"\n== {log.name}\n{log.read_text()}"
                                      for log in (ffn_log, *logs.values())))  # fmt: skip

    try:
        for r in (0, 1):
            servers[r] = wait_until_healthy(servers[r], ports[r], logs[r])
        streams = {
            r: StreamingCompletions(ports[r], tiny_qwen3, [PROMPTS[p] for p in prompts], 24)
            for r in (0, 1)
        }
        streams[0].wait_for(STREAMS_PER_RANK, report)  # mid-run: 8 at a time, 384 tokens
        kill_engine(servers[0])
        wait_for_log(ffn, ffn_log, DROPPED, report, timeout_s=60)
        streams[0].join(timeout_s=120)  # failed back, none left hanging
        streams[1].join()
        assert ffn.poll() is None, report()  # serving on, keeping rank 0's place
    finally:
        for server in servers.values():
            stop(server)
        ffn.kill()
    lost = streams[0]
    print("rank 0's requests:", len(lost.finished()), "finished,", len(lost.errors), "failed:",
          lost.errors[:1])  # fmt: skip
    failed = {int(e.split(":")[0].removeprefix("request ")) for e in lost.errors}
    assert failed and failed | lost.finished() == set(range(STREAMS_PER_RANK)), lost.errors
    assert all("EngineCore encountered an issue" in e for e in lost.errors), lost.errors
    assert not streams[1].errors, (streams[1].errors, report())
    assert streams[1].tokens == [reference[p] for p in prompts], report()
