# SPDX-License-Identifier: Apache-2.0
"""The attention engines' AFD figures in vLLM's own ``/metrics``.

Each attention rank's worker puts its cumulative figures on every step's
``ModelRunnerOutput.afd_stats`` (``afd_step``); the scheduler passes the
latest on in ``SchedulerStats.afd_stats``, which reaches the frontend as
vLLM's other scheduler stats do; there ``PrometheusStatLogger`` hands them
to ``AFDAttentionProm``, which turns them into counters labelled like
vLLM's own (``model_name``, ``engine``). The figures are cumulative, so a
step whose stats vLLM does not forward loses nothing; each counter grows by
the difference to the last figures seen from its engine.

The FFN ranks export their own side on their ``metrics_port``
(``vllm/afd/ffn_endpoints.py``).
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
        self._last: dict[int, dict[str, float]] = {}
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
        timed = {}
        if afd.time_steps:
            for figure, documentation in (
                ("timed_steps", "Real steps timed (AFD time_steps)"),
                ("compute_seconds", "This engine's own work in its timed steps"),
                (
                    "exchange_seconds",
                    "Time this engine spent in AFD transfers in its timed steps, "
                    "waiting for the FFN rank included",
                ),
            ):
                timed[figure] = self._counter_cls(
                    name=f"vllm:afd_{figure}", documentation=documentation, labelnames=labelnames
                )
        for engine, values in per_engine_labelvalues.items():
            counters = {figure: steps.labels(*values, kind) for kind, figure in STEP_KINDS.items()}
            counters["tokens"] = tokens.labels(*values)
            counters |= {figure: counter.labels(*values) for figure, counter in timed.items()}
            self._counters[engine] = counters

    def observe(self, afd_stats: dict[str, float], engine_idx: int = 0) -> None:
        """Advance engine ``engine_idx``'s counters to its figures ``afd_stats``."""
        counters = self._counters.get(engine_idx)
        if counters is None:
            return
        last = self._last.get(engine_idx, {})
        for figure, counter in counters.items():
            grown = afd_stats.get(figure, 0.0) - last.get(figure, 0.0)
            if grown > 0:
                counter.inc(grown)
        self._last[engine_idx] = afd_stats
