"""A dead FFN rank loses no request (``failover_timeout_s``).

`vllm serve` answers 32 concurrent streaming greedy completions while its
FFN rank is killed (SIGKILL) twice, and a respawn once while it starts;
its attention ranks keep their requests and KV cache, wait for an FFN
rank in the lost one's place (starting another if it dies), run the
forward in flight again, and every answer equals stock colocated vLLM's,
token for token. The replacements are each kind a deployment has: a
respawn (``spawn_ffn``), a standby started in advance, and a hand-started
`vllm afd-ffn`, whose checkpoint, in the negative control, has a zeroed
layer: the answers in flight then differ from stock's, so the comparison
sees the tokens computed after a failover. A last kill with no replacement
ends the deployment, naming the lost rank, within ``failover_timeout_s``.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from vllm_afd_dev.harness.generate import (
    PROMPTS,
    failure_report,
    free_port,
    spawned_ffn_processes,
)
from vllm_afd_dev.harness.launch import (
    RAN_AGAIN,
    SERVE_ENGINE,
    TOOK_OVER,
    StreamingCompletions,
    ffn_server,
    scrape_until,
    serve,
    stop,
    total,
    wait_until_healthy,
)
from vllm_afd_dev.models.tiny_model import with_zeroed_mlp

STREAMS = 32
MAX_TOKENS = 24


class Streams(StreamingCompletions):
    """``STREAMS`` completions of ``MAX_TOKENS``, the standard prompts in turn."""

    def __init__(self, port: int, model: Path) -> None:
        self.prompts = [i % len(PROMPTS) for i in range(STREAMS)]
        super().__init__(port, model, [PROMPTS[p] for p in self.prompts], MAX_TOKENS)


def next_spawned_ffn(afd_port: int, killed: set[int], timeout_s: float = 60):
    """The FFN process that ``spawn_ffn`` starts after those in ``killed``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = [p for p in spawned_ffn_processes(afd_port) if p.pid not in killed]
        if started:
            return started[0]
        time.sleep(0.05)
    raise AssertionError(f"no FFN process started in the lost one's place in {timeout_s} s")


def afd_config(**config: object) -> tuple[str, str]:
    return "--afd-config", json.dumps({"port": free_port(), **config})


def failover_metrics(port: int, failovers: int) -> dict:
    """The API server's failover counters, once its engines have reported
    ``failovers`` (vLLM's frontend records a step's stats after its outputs)."""
    return scrape_until(
        port,
        "vllm:afd_failover",
        lambda samples: total(samples, "vllm:afd_failovers_total") >= failovers,
    )


def logged_pauses_s(log: str) -> list[float]:
    """The seconds from loss to replacement that the attention ranks logged."""
    return [float(s) for s in re.findall(re.escape(TOOK_OVER) + r" ([0-9.]+) s", log)]


def test_a_spawned_ffn_rank_killed_twice_under_load_loses_no_request(
    tiny_qwen3, colocated, tmp_path
):
    reference = colocated(tiny_qwen3)["tokens"]
    port, log = free_port(), tmp_path / "serve.log"
    config = afd_config(spawn_ffn=True, failover_timeout_s=300)
    afd_port = json.loads(config[1])["port"]
    server = serve(tiny_qwen3, port, log, *SERVE_ENGINE, *config)

    def report() -> str:
        return failure_report(log.read_text())

    try:
        server = wait_until_healthy(server, port, log)
        streams = Streams(port, tiny_qwen3)
        killed = set()
        for kill in range(2):
            # mid-run: prefills and decodes
            streams.wait_for(streams.count + 2 * STREAMS // 3, report)
            [ffn] = spawned_ffn_processes(afd_port)
            assert ffn.pid not in killed, "the killed FFN process still serves"
            ffn.send_signal(signal.SIGKILL)
            killed.add(ffn.pid)
            if kill == 0:
                # The first respawn dies too, while it starts: another follows.
                respawn = next_spawned_ffn(afd_port, killed)
                respawn.send_signal(signal.SIGKILL)
                killed.add(respawn.pid)
        streams.join()
        metrics = failover_metrics(port, failovers=2)
    finally:
        stop(server)
    text = log.read_text()
    assert not streams.errors, (streams.errors, report())
    assert streams.tokens == [reference[p] for p in streams.prompts], report()
    assert text.count(TOOK_OVER) == 2, report()
    ran_again = RAN_AGAIN.findall(text)
    print(f"lost to connected {logged_pauses_s(text)} s; to the lost step run again {ran_again} s")
    assert len(ran_again) == 2, report()
    # /metrics counts both, and the time their requests waited (logged to 0.1 s)
    assert total(metrics, "vllm:afd_failovers_total") == 2, metrics
    paused_s = total(metrics, "vllm:afd_failover_pause_seconds_total")
    assert abs(paused_s - sum(logged_pauses_s(text))) <= 0.1, (paused_s, report())
    assert text.count("exited before it accepted connections; its log is above") == 1, report()
    assert "AFD FFN rank 0: shutdown after" in text, report()


def test_2a1f_standby_and_hand_started_replacements_then_no_replacement(
    tiny_qwen3, colocated, tmp_path
):
    """2A1F: the hand-started FFN rank is killed and the standby takes its
    place (answers equal stock's); the standby is killed and a hand-started
    one with a zeroed layer takes its place (answers in flight differ: the
    negative control); that one is killed with none to follow, and the
    deployment ends, naming the lost rank, within ``failover_timeout_s``."""
    reference = colocated(tiny_qwen3)["tokens"]
    failover_s = 60
    port, log = free_port(), tmp_path / "serve.log"
    config = afd_config(num_attention_ranks=2, failover_timeout_s=failover_s)
    afd_port = json.loads(config[1])["port"]
    ffn_logs = [tmp_path / f"ffn{i}.log" for i in range(3)]
    ffn = ffn_server(tiny_qwen3, afd_port, ffn_logs[0], num_attention_ranks=2)
    server = serve(tiny_qwen3, port, log, *SERVE_ENGINE, "--data-parallel-size", "2", *config)
    standby = mismatched = replacement = None

    def report() -> str:
        return failure_report(
            log.read_text() + "".join(f"\n== {f.name}\n{f.read_text()}" for f in ffn_logs
                                      if f.exists())
        )  # fmt: skip

    try:
        server = wait_until_healthy(server, port, log)
        standby = ffn_server(tiny_qwen3, afd_port, ffn_logs[1], num_attention_ranks=2, standby=True)
        # One for another topology is refused before any failure, not at one.
        mismatched_log = tmp_path / "mismatched-standby.log"
        mismatched = ffn_server(tiny_qwen3, afd_port, mismatched_log, standby=True)
        assert mismatched.wait(timeout=300) != 0, mismatched_log.read_text()
        assert "num_attention_ranks: ffn=2, standby=1" in mismatched_log.read_text()
        deadline = time.monotonic() + 300
        while "waiting to take the place of the FFN rank" not in ffn_logs[1].read_text():
            assert standby.poll() is None and time.monotonic() < deadline, report()
            time.sleep(1)
        # checked against the FFN rank it backs, before the failure
        assert "it can take the place of the FFN rank on" in ffn_logs[1].read_text(), report()
        streams = Streams(port, tiny_qwen3)
        streams.wait_for(2 * STREAMS // 3, report)
        ffn.kill()
        streams.wait_for(streams.count + 2 * STREAMS // 3, report)  # the standby serves
        before_control = streams.finished()
        standby.kill()
        broken = with_zeroed_mlp(tiny_qwen3, tmp_path / "zeroed", layer=1)
        replacement = ffn_server(broken, afd_port, ffn_logs[2], num_attention_ranks=2)
        streams.join()
        assert not streams.errors, (streams.errors, report())
        answers = [(streams.tokens[i], reference[p]) for i, p in enumerate(streams.prompts)]
        # Before the zeroed replacement: stock's answers; those it served
        # parts of: not.
        assert all(ours == stock for i, (ours, stock) in enumerate(answers)
                   if i in before_control), report()  # fmt: skip
        changed = [i for i, (ours, stock) in enumerate(answers) if ours != stock]
        assert changed and not set(changed) & before_control, (changed, report())
        assert log.read_text().count(TOOK_OVER) == 4, report()  # two failovers, two ranks
        metrics = failover_metrics(port, failovers=4)
        took_over = [line for line in log.read_text().splitlines() if TOOK_OVER in line]
        for engine in ("0", "1"):
            failovers = total(metrics, "vllm:afd_failovers_total", engine=engine)
            assert failovers == 2, (engine, sorted(metrics.items()), took_over)

        streams = Streams(port, tiny_qwen3)
        streams.wait_for(STREAMS // 2, report)
        replacement.kill()
        killed_at = time.monotonic()
        streams.join(timeout_s=failover_s + 60)
        ended_after = time.monotonic() - killed_at
    finally:
        for proc in (ffn, standby, mismatched, replacement):
            if proc is not None:
                proc.kill()
        stop(server)
    assert streams.errors, "requests completed without an FFN rank"
    assert ended_after < failover_s + 30, ended_after
    text = log.read_text()
    assert f"and no FFN rank took its place within {failover_s} s" in text, report()
