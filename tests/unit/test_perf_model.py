"""The AFD performance model (benchmarks/afd_perf_model.py): its fit
recovers known components, and its check compares every measured point."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from afd_perf_model import Model, check, fit  # noqa: E402

TRUE = Model(a0=0.4, a1=0.002, f0=2.6, f1=0.001, x0=0.2, x1=0.0005, tail=0.3, h1=0.02,
             c0=0.7, c1=0.003, layers=8)  # fmt: skip
BATCHES = [64, 128, 256, 512]


def measured_by(model: Model) -> dict:
    """A benchmark result as afd_moe_decode.py saves it, made by ``model``."""
    roles, ms = {}, {"AFD": {}, "AFD overlap": {}, "colocated DP2": {}}
    for b in BATCHES:
        step = model.afd_step(1, 1, b)
        gpu = model.attention(b) + model.ffn(b) + model.exchange(b)
        roles[str(b)] = {
            "attention": model.attention(b),
            "ffn": model.ffn(b),
            "attention_exchange": model.ffn(b) + model.exchange(b),
            "other": step - gpu,
        }
        ms["AFD"][str(b)] = step
        ms["AFD overlap"][str(b)] = model.afd_step(1, 1, b, stages=2)
        ms["colocated DP2"][str(b)] = model.colocated_step(2, b // 2)
    return {"role_times_ms": {"AFD": roles}, "ms_per_step": ms, "stages": 2,
            "model": {"num_hidden_layers": 8}}  # fmt: skip


def test_the_fit_recovers_the_components_and_the_check_sees_no_error():
    results = measured_by(TRUE)
    model = fit(results, [64, 256])
    for name in ("a0", "a1", "f0", "f1", "x0", "x1", "tail", "h1", "c0", "c1"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-9)
    rows = check(model, results, [64, 256])
    assert len(rows) == 3 * len(BATCHES) - 2  # colocated is calibrated at two batches
    assert all(abs(err) < 1e-9 for *_, err in rows)


def test_the_check_reports_a_wrong_measurement():
    results = measured_by(TRUE)
    results["ms_per_step"]["AFD overlap"]["128"] *= 1.3
    rows = check(fit(results, [64, 256]), results, [64, 256])
    errors = {(name, b): err for name, b, _, _, err in rows}
    assert errors[("AFD overlap", 128)] == pytest.approx(1 / 1.3 - 1)


def test_stages_pay_the_weight_read_once_each():
    single = TRUE.afd_step(1, 1, 64)
    two = TRUE.afd_step(1, 1, 64, stages=2)
    # FFN-bound at this batch: two passes read the weights twice.
    assert two - TRUE.exchange(64) - TRUE.tail == pytest.approx(TRUE.ffn(64, stages=2))
    assert two > single
