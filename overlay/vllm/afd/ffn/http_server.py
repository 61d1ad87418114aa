# SPDX-License-Identifier: Apache-2.0
"""An FFN rank's HTTP endpoints for orchestrators: ``/health`` and ``/metrics``.

vLLM's API server serves both for the attention side; an FFN rank has no API
server. With ``AFDConfig.metrics_port`` the leader process of FFN rank f
serves them on ``host``, port ``metrics_port + f``:

- ``/health``: 200 while the rank serves all its attention peers (or, as
  attention ranks of their own with ``failover_timeout_s``, the others
  after a loss, naming it); 503 with
  the reason while it loads its weights or waits for its peers, and once it
  stops (a lost peer, or shutdown).
- ``/metrics``: Prometheus text. Counters are read from the runner and the
  endpoint when scraped, so serving costs the step loop nothing; the
  step-time histograms fill only with ``time_steps``, which times the steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from vllm.afd.ffn.runner import FFNModelRunner
    from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint

PREFIX = "vllm_afd_ffn_"

# Per-step times of the tiny CPU model (milliseconds) up to a large GPU
# model's prefill (seconds).
STEP_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class FFNRankState:
    """What the endpoints report about one FFN rank; the worker moves it
    through its phases."""

    def __init__(self, ffn_rank: int) -> None:
        self.ffn_rank = ffn_rank
        self.phase = "loading weights"
        self.runner: FFNModelRunner | None = None
        self.endpoint: FFNEndpoint | None = None

    def health(self) -> tuple[bool, str]:
        """(serving all peers, what it is doing)."""
        endpoint = self.endpoint
        if endpoint is not None:
            if endpoint.stop_reason is not None:
                return False, f"stopping: {endpoint.stop_reason}"
            lost = endpoint.lost_peers()
            if lost and endpoint.serves_others_on:
                # Still serving the others, each lost place kept for a restart.
                return self.phase == "serving", f"{self.phase}; lost attention rank(s) {lost}"
            if lost:
                return False, f"lost attention rank(s) {lost}"
        return self.phase == "serving", self.phase

    def peers_connected(self) -> int:
        endpoint = self.endpoint
        if endpoint is None or self.phase != "serving":
            return 0
        return len(endpoint.peer_ranks) - len(endpoint.lost_peers())


class _FFNRankCollector:
    """Reads the rank's counters at scrape time."""

    def __init__(self, state: FFNRankState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state, rank = self.state, str(self.state.ffn_rank)
        labels = ["ffn_rank"]
        steps = CounterMetricFamily(
            PREFIX + "steps",
            "Steps this FFN rank ran, by how: CUDA graph capture, replay, or eager "
            "(warm-up and profile steps included)",
            labels=[*labels, "kind"],
        )
        weights = GaugeMetricFamily(
            PREFIX + "weight_bytes", "Bytes of FFN weights this process holds", labels=labels
        )
        if state.runner is not None:
            stats = state.runner.graphs.stats
            for kind, value in (
                ("capture", stats.captures),
                ("replay", stats.replays),
                ("eager", stats.eager),
            ):
                steps.add_metric([rank, kind], value)
            if state.runner.model is not None:
                weights.add_metric([rank], state.runner.model.weight_bytes)
        tokens = CounterMetricFamily(
            PREFIX + "tokens",
            "Tokens of real (request) steps this FFN rank ran, by attention rank",
            labels=[*labels, "attention_rank"],
        )
        if state.endpoint is not None:
            for peer, count in state.endpoint.accounting.request_tokens.items():
                tokens.add_metric([rank, str(peer)], count)
        peers = GaugeMetricFamily(
            PREFIX + "peers_connected",
            "Attention ranks this FFN rank serves now",
            labels=labels,
        )
        peers.add_metric([rank], state.peers_connected())
        yield from (steps, tokens, peers, weights)


class FFNHttpServer:
    """The HTTP server of one FFN rank's ``/health`` and ``/metrics``."""

    def __init__(self, host: str, port: int, state: FFNRankState) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        self.registry.register(_FFNRankCollector(state))
        rank = str(state.ffn_rank)
        self.step_seconds = {
            part: Histogram(
                PREFIX + f"step_{part}_seconds",
                f"Per real step, the FFN rank's {what} (with time_steps)",
                ["ffn_rank"],
                registry=self.registry,
                buckets=STEP_SECONDS_BUCKETS,
            ).labels(rank)
            for part, what in (
                ("compute", "own work"),
                ("exchange", "time in data-plane calls: transfers and waiting for peers"),
            )
        }
        try:
            self._server = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            raise OSError(
                f"AFD FFN rank {state.ffn_rank} cannot serve /health and /metrics on "
                f"{host}:{port}: {e}. Pick a free metrics_port in the AFD config (FFN rank f "
                "uses metrics_port + f)."
            ) from e
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"afd-ffn-{rank}-endpoints", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def observe_step(self, compute_ms: float, exchange_ms: float) -> None:
        self.step_seconds["compute"].observe(compute_ms / 1000)
        self.step_seconds["exchange"].observe(exchange_ms / 1000)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(endpoints: FFNHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a client that connects and sends nothing is dropped

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                serving, what = endpoints.state.health()
                self._reply(200 if serving else 503, "text/plain", f"{what}\n".encode())
            elif self.path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(endpoints.registry))
            else:
                self._reply(404, "text/plain", b"AFD FFN rank: /health or /metrics\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a probe every few seconds would flood the rank's log

    return Handler
