"""An FFN rank's /health and /metrics server on its own: what it says before
the rank serves, and a clear error when its port is taken. Scraped from a
serving FFN rank in tests/e2e/test_cli.py."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm.afd.ffn.http_server import FFNHttpServer, FFNRankState
from vllm.config.afd import AFDConfig

from vllm_afd_dev.harness.launch import http_get as get


@pytest.fixture
def endpoints():
    served = FFNHttpServer("127.0.0.1", 0, FFNRankState(ffn_rank=3))
    yield served
    served.close()


def test_a_loading_rank_is_not_healthy_and_serves_no_peer(endpoints):
    assert endpoints.address.startswith("127.0.0.1:")  # the configured host only
    assert get(endpoints.address, "/health") == (503, "loading weights\n")
    endpoints.state.phase = "waiting for attention peers"
    assert get(endpoints.address, "/health") == (503, "waiting for attention peers\n")
    status, text = get(endpoints.address, "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("vllm_afd_ffn_peers_connected", (("ffn_rank", "3"),))] == 0
    assert get(endpoints.address, "/other")[0] == 404


def test_a_taken_port_says_which_setting_to_change(endpoints):
    port = int(endpoints.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="Pick a free metrics_port"):
        FFNHttpServer("127.0.0.1", port, FFNRankState(ffn_rank=0))


def test_metrics_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match="metrics_port 70000 is out of range"):
        AFDConfig(role="ffn", metrics_port=70000)


@pytest.mark.parametrize("serves_others_on", [False, True])
def test_a_lost_attention_rank_is_unhealthy_unless_the_others_are_served_on(serves_others_on):
    """Attention ranks of their own with failover_timeout_s: a lost one's
    place waits for a restart and the rank serves the others, so an
    orchestrator must not restart it; else the rank stops."""
    from types import SimpleNamespace

    state = FFNRankState(ffn_rank=0)
    state.phase = "serving"
    state.endpoint = SimpleNamespace(
        stop_reason=None,
        lost_peers=lambda: [1],
        peer_ranks=[0, 1],
        serves_others_on=serves_others_on,
    )
    assert state.health() == (
        (True, "serving; lost attention rank(s) [1]")
        if serves_others_on
        else (False, "lost attention rank(s) [1]")
    )
    assert state.peers_connected() == 1
