# SPDX-License-Identifier: Apache-2.0
"""The attention engines' AFD figures in vLLM's own ``/metrics``.

Each attention rank's worker puts on a step's ``ModelRunnerOutput.afd_stats``
how far its figures grew since the last output that carried them
(``afd_step``); the scheduler passes that on in ``SchedulerStats.afd_stats``
to one front-end, as vLLM's other scheduler stats go; there
``PrometheusStatLogger`` hands it to ``AFDAttentionProm``, which adds it to
counters labelled like vLLM's own (``model_name``, ``engine``). With several
API servers (vLLM's default under data parallelism) each adds what reaches
it, and vLLM's multi-process collector sums them.

The FFN ranks export their own side on their ``metrics_port``
(``vllm/afd/ffn/http_server.py``).
"""

from __future__ import annotations

import prometheus_client
from vllm.config import VllmConfig

STEP_KINDS = {"capture": "capture_steps", "replay": "replay_steps", "eager": "eager_steps"}
"""The ``kind`` label of ``vllm:afd_steps_total``: the figure it counts."""


class AFDAttentionProm:
    """Counters of one frontend's attention engines; none without AFD."""

    _counter_cls = prometheus_client.Counter

    def __init__(
        self,
        vllm_config: VllmConfig,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self._counters: dict[int, dict[str, prometheus_client.Counter]] = {}
        """Per engine: the figure each counter follows."""
        afd = vllm_config.afd_config
        if afd is None:
            return
        steps = self._counter_cls(
            name="vllm:afd_steps",
            documentation="Forward steps this attention engine announced to its FFN rank, "
            "by how they ran: CUDA graph capture, replay, or eager (warm-up and profile "
            "steps included)",
            labelnames=[*labelnames, "kind"],
        )
        tokens = self._counter_cls(
            name="vllm:afd_tokens",
            documentation="Tokens of real (request) steps this attention engine sent to "
            "its FFN rank, once per step (every layer sends them)",
            labelnames=labelnames,
        )
        # Counters that follow one figure each, present with the settings that make them.
        figures: list[tuple[str, str]] = []
        if afd.time_steps:
            figures += [
                ("timed_steps", "Real steps timed (AFD time_steps)"),
                ("compute_seconds", "This engine's own work in its timed steps"),
                ("exchange_seconds", "Time this engine spent in AFD transfers in its timed "
                 "steps, waiting for the FFN rank included"),
            ]  # fmt: skip
        if afd.failover_timeout_s:
            figures += [
                ("failovers", "FFN ranks this attention engine lost and saw replaced "
                 "(AFD failover_timeout_s)"),
                ("failover_pause_seconds", "Time this attention engine's requests waited "
                 "for those replacements, from each loss to the replacement's handshake"),
            ]  # fmt: skip
        single = {
            figure: self._counter_cls(
                name=f"vllm:afd_{figure}", documentation=documentation, labelnames=labelnames
            )
            for figure, documentation in figures
        }
        for engine, values in per_engine_labelvalues.items():
            counters = {figure: steps.labels(*values, kind) for kind, figure in STEP_KINDS.items()}
            counters["tokens"] = tokens.labels(*values)
            counters |= {figure: counter.labels(*values) for figure, counter in single.items()}
            self._counters[engine] = counters

    def observe(self, afd_stats: dict[str, float], engine_idx: int = 0) -> None:
        """Add how engine ``engine_idx``'s figures grew (``afd_stats``)."""
        for figure, counter in self._counters.get(engine_idx, {}).items():
            grown = afd_stats.get(figure, 0.0)
            if grown > 0:
                counter.inc(grown)
