"""The AFD performance model (vllm_afd_dev.bench.perf_model, the command
benchmarks/afd_perf_model.py): its fit
recovers known components, its check compares every measured point, and on
the stored measurements it reproduces the 48-layer calibration points."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from vllm_afd_dev.bench.perf_model import ONE_GPU_ROWS, Model, check, fit, role_time_points
from vllm_afd_dev.bench.results import RESULTS

TRUE = Model(layers=48, experts=128, top_k=8, a0=2.4, a1=0.012, a_kv=2e-5, f_w=15.0,
             f1=0.004, x0=1.3, x1=0.0035, tail=0.3, h1=0.026, c0=2.5, c1=0.075)  # fmt: skip
SHARED_GPU = {"x0": 1.1, "x1": 0.0001, "tail": 0.55}
POINTS = [(64, 8192), (128, 512), (512, 1024)]
"""(batch, prompt length) of the role-time file."""
TWO_GPU_BATCHES = [64, 128, 256, 512]
ONE_GPU_BATCHES = [1, 8, 32, 128, 256]
CALIBRATE = [64, 256]


def measured_by(model: Model) -> tuple[dict, dict, dict]:
    """The three input files as the benchmarks save them, made by ``model``:
    (one-GPU role times, two GPUs at 8 layers, one-GPU steps)."""
    one_gpu = replace(model, **SHARED_GPU)
    decoded = 16 * (1 + 3) / 2  # role_time_points: decode_tokens 16, repeats 3
    points = [(b, length + decoded) for b, length in POINTS]
    roles = {}
    for b, c in points:
        afd = one_gpu.afd_step(1, 1, b, context=c)
        roles[str(b)] = {
            "attention": one_gpu.attention(b, context=c),
            "ffn": one_gpu.ffn(b),
            "attention_exchange": one_gpu.ffn(b) + one_gpu.exchange(b),
            "other": afd - one_gpu.attention(b, context=c) - one_gpu.ffn(b) - one_gpu.exchange(b),
        }
    role_file = {
        "model": {"num_local_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48},
        "decode_tokens": 16,
        "repeats": 3,
        "points": [
            {"batch": b, "context": length,
             "ms_per_step": {"AFD": [one_gpu.afd_step(1, 1, b, context=c)],
                             "colocated": [one_gpu.colocated_step(1, b, c)]}}
            for (b, length), (_, c) in zip(POINTS, points, strict=True)
        ],
        "role_times_ms": {"AFD": roles},
    }  # fmt: skip

    shallow, c = model.scaled(8), 16 + 64 / 2
    two_roles, ms = {}, {"AFD": {}, "AFD overlap": {}, "colocated DP2": {}}
    for b in TWO_GPU_BATCHES:
        step = shallow.afd_step(1, 1, b, context=c)
        att, ffn, x = shallow.attention(b, context=c), shallow.ffn(b), shallow.exchange(b)
        two_roles[str(b)] = {"attention": att, "ffn": ffn, "attention_exchange": ffn + x,
                             "other": step - att - ffn - x}  # fmt: skip
        ms["AFD"][str(b)] = step
        ms["AFD overlap"][str(b)] = shallow.afd_step(1, 1, b, stages=2, context=c)
        ms["colocated DP2"][str(b)] = shallow.colocated_step(2, b // 2, c)
    two_gpu = {"model": {"num_hidden_layers": 8}, "decode_tokens": 64, "stages": 2,
               "role_times_ms": {"AFD": two_roles}, "ms_per_step": ms}  # fmt: skip

    c = 16 + 32 / 2
    steps = {
        ONE_GPU_ROWS["AFD"]: {str(b): [one_gpu.afd_step(1, 1, b, context=c)]
                              for b in ONE_GPU_BATCHES},
        ONE_GPU_ROWS["colocated"]: {str(b): [one_gpu.colocated_step(1, b, c)]
                                    for b in ONE_GPU_BATCHES},
    }  # fmt: skip
    one_gpu_steps = {"model": {"num_hidden_layers": 48}, "decode_tokens": 32,
                     "ms_per_output_token": steps}  # fmt: skip
    return role_file, two_gpu, one_gpu_steps


def stored(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_the_fit_recovers_the_components_and_the_check_sees_no_error():
    files = measured_by(TRUE)
    model, one_gpu = fit(files[0], files[1], CALIBRATE)
    for name in ("a0", "a1", "a_kv", "f_w", "f1", "x0", "x1", "tail", "h1", "c0", "c1"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    for name, value in SHARED_GPU.items():
        assert getattr(one_gpu, name) == pytest.approx(value, rel=1e-6)
    rows = check(model, one_gpu, *files, CALIBRATE)
    # 4 rows per role-time point, 2 per one-GPU batch, 4 per two-GPU batch and
    # colocated DP2 where c_dp was not solved.
    assert len(rows) == 4 * 3 + 2 * 5 + 4 * 4 + 2
    assert all(abs(r.error) < 1e-9 for r in rows)


def test_the_check_reports_a_wrong_measurement():
    files = measured_by(TRUE)
    files[1]["ms_per_step"]["AFD overlap"]["128"] *= 1.3
    model, one_gpu = fit(files[0], files[1], CALIBRATE)
    rows = check(model, one_gpu, *files, CALIBRATE)
    errors = {(r.source, r.row, r.batch): r.error for r in rows}
    assert errors[("two GPUs, 8 layers", "AFD overlap", 128)] == pytest.approx(1 / 1.3 - 1)


def test_stages_pay_the_weight_read_once_each():
    single = TRUE.afd_step(1, 1, 64)
    two = TRUE.afd_step(1, 1, 64, stages=2)
    # FFN-bound at this batch: two passes of 32 tokens, each reading the
    # experts that its tokens touch (87% of them, against 98% for 64 tokens).
    assert two - TRUE.exchange(64) - TRUE.tail == pytest.approx(TRUE.ffn(64, stages=2))
    assert TRUE.ffn(64, stages=2) == pytest.approx(2 * TRUE.ffn(32))
    assert two > single


def test_the_fit_reproduces_the_full_depth_calibration_points():
    """Attention has three terms for three points: exact. FFN has two for
    three: within 1%."""
    role_file = stored("afd_one_gpu_overlap_qwen3-30b-a3b.json")
    model, one_gpu = fit(role_file, stored("afd_moe_decode.json"), CALIBRATE)
    assert model.layers == 48
    for p in role_time_points(role_file):
        assert one_gpu.attention(p.batch, context=p.context) == pytest.approx(
            p.roles["attention"], rel=1e-9
        )
        assert one_gpu.ffn(p.batch) == pytest.approx(p.roles["ffn"], rel=0.01)


def test_a_fit_to_wrong_role_times_misses_the_measured_ones():
    """The 1% above tells a fit to the measurements from one to times 10% off
    at a single point."""
    role_file = stored("afd_one_gpu_overlap_qwen3-30b-a3b.json")
    two_gpu = stored("afd_moe_decode.json")
    wrong = copy.deepcopy(role_file)
    wrong["role_times_ms"]["AFD"]["128"]["attention"] *= 1.1
    wrong["role_times_ms"]["AFD"]["512"]["ffn"] *= 1.1
    _, one_gpu = fit(wrong, two_gpu, CALIBRATE)
    points = role_time_points(role_file)
    attention_miss = max(
        abs(one_gpu.attention(p.batch, context=p.context) / p.roles["attention"] - 1)
        for p in points
    )
    ffn_miss = max(abs(one_gpu.ffn(p.batch) / p.roles["ffn"] - 1) for p in points)
    assert attention_miss > 0.05
    assert ffn_miss > 0.01


def test_the_model_predicts_the_one_gpu_steps_it_was_not_fitted_on():
    """One-GPU decode steps at 48 layers, short prompts, batch 8 to 256:
    within 10% (batch 1 is not: fixed FFN costs that saturated points cannot
    show)."""
    role_file = stored("afd_one_gpu_overlap_qwen3-30b-a3b.json")
    two_gpu = stored("afd_moe_decode.json")
    steps = stored("afd_gpu_decode_qwen3-30b-a3b.json")
    model, one_gpu = fit(role_file, two_gpu, CALIBRATE)
    rows = check(model, one_gpu, role_file, two_gpu, steps, CALIBRATE)
    rows = [r for r in rows if r.source == "one GPU, steps"]
    assert {r.batch for r in rows} == {1, 8, 32, 128, 256}
    assert all(abs(r.error) < 0.10 for r in rows if r.batch >= 8)
