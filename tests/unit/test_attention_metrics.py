"""The attention engines' ``vllm:afd_*`` counters count each figure's growth
once: with several API servers (vLLM's default under data parallelism)
each step's stats reach one of them, and a failover's redone step is not
counted twice."""

from __future__ import annotations

import functools

import prometheus_client
from vllm.afd.attention.metrics import AFDAttentionProm
from vllm.config import VllmConfig
from vllm.distributed.afd_transfer.accounting import AttentionAccounting
from vllm.distributed.afd_transfer.step_stats import NULL_TIMELINE
from vllm.engine.arg_utils import EngineArgs


def with_failover(model) -> VllmConfig:
    """An attention rank's config with failover on, so every counter exists."""
    return EngineArgs(
        model=str(model), afd_config={"failover_timeout_s": 60}
    ).create_engine_config()


def attention_accounting() -> AttentionAccounting:
    return AttentionAccounting(peer_index=0, timeline=NULL_TIMELINE)


def api_server(
    vllm_config: VllmConfig,
) -> tuple[AFDAttentionProm, prometheus_client.CollectorRegistry]:
    """One API server's AFD counters, in a registry of their own (each
    server is a process of its own)."""
    registry = prometheus_client.CollectorRegistry()

    class Prom(AFDAttentionProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    return Prom(vllm_config, ["engine"], {0: ["0"]}), registry


def test_a_growth_is_reported_once_and_a_rolled_back_step_not_again():
    accounting = attention_accounting()
    accounting.tokens_sent = 10
    assert accounting.stats_to_report()["tokens"] == 10
    assert accounting.stats_to_report()["tokens"] == 0
    # A failover rolls back the redone step's 4 tokens; sent again, they were counted.
    accounting.tokens_sent = 6
    assert accounting.stats_to_report()["tokens"] == 0
    accounting.tokens_sent = 10
    assert accounting.stats_to_report()["tokens"] == 0
    accounting.tokens_sent, accounting.failovers = 13, 1
    reported = accounting.stats_to_report()
    assert (reported["tokens"], reported["failovers"]) == (3, 1)


def test_api_servers_that_take_turns_count_each_step_once(tiny_qwen3):
    """vLLM hands each step's stats to one API server; its collector sums
    the servers' counters."""
    config = with_failover(tiny_qwen3)
    accounting = attention_accounting()
    servers = [api_server(config) for _ in range(2)]
    for step in range(1, 6):
        accounting.tokens_sent, accounting.failovers = 8 * step, step // 2
        servers[step % 2][0].observe(accounting.stats_to_report())
    summed = {
        name: sum(registry.get_sample_value(name, {"engine": "0"}) for _, registry in servers)
        for name in ("vllm:afd_tokens_total", "vllm:afd_failovers_total")
    }
    assert summed == {"vllm:afd_tokens_total": 40.0, "vllm:afd_failovers_total": 2.0}
