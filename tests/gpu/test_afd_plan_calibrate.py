"""``vllm afd-plan --calibrate`` on one GPU: Qwen3-30B-A3B's shape (48
layers, dummy weights) measured at the default points, cut to the depth
that fits beside its FFN rank, fitted and saved; the fit must reproduce
each role's measured time and the one-GPU decode step it was not fitted to
(``calibrate.fit_rates`` fits the roles and only a constant tail of the
step), and the saved profile must plan."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from vllm.afd.plan.cost import CostModel
from vllm.afd.plan.hardware import PRESETS
from vllm.afd.plan.rates import Profile
from vllm.afd.plan.shapes import QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, load_shape

from vllm_afd_dev.bench.shapes import shaped_model
from vllm_afd_dev.harness.generate import worker_env

CALIBRATE_TIMEOUT_S = 540
ROLE_ERROR = 0.15
"""Each role's fitted time within this of its measurement, batches 8 and up
(batch 1 is the FFN's fixed cost, which the fit gets from one point)."""
STEP_ERROR = 0.15
CUT = re.compile(r"calibrating on (?:all (\d+) layers|(\d+) of (\d+) layers)")


def preset() -> str:
    name = torch.cuda.get_device_name()
    return next((p for p in ("H200", "H100", "B200") if p in name), "H200")


def test_calibration_fits_this_gpu_and_plans_with_its_profile(tmp_path: Path, tiny_qwen3_moe):
    model = shaped_model(
        tmp_path / "qwen3-30b-a3b",
        dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS),
        base=tiny_qwen3_moe,
    )
    profile = tmp_path / "profile.json"
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "afd-plan",
               "--model", str(model), "--gpu", preset(), "--gpus", "8",
               "--calibrate", "--profile", str(profile)]  # fmt: skip
    out = subprocess.run(
        command,
        env=worker_env() | {"CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=CALIBRATE_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith("calibrat")))
    depth = CUT.search(out.stdout)
    assert depth, out.stdout[-2000:]
    layers = int(depth.group(1) or depth.group(2))
    assert 1 <= layers <= QWEN3_30B_A3B_LAYERS

    saved = Profile.load(profile)
    assert preset() in saved.gpu and saved.model == str(model)
    rows = saved.points
    assert {r["role"] for r in rows} == {"attention", "ffn", "step"}
    for r in rows:
        assert r["measured_ms"] > 0, r
        bound = STEP_ERROR if r["role"] == "step" else ROLE_ERROR
        if r["batch"] >= 8:
            assert abs(r["error"]) <= bound, r
    # The saved rates reproduce the saved fit, and the same check fails for
    # rates off by a factor two in the weights' read (negative control).
    cost = CostModel(load_shape(str(model), layers), PRESETS[preset()], saved.rates)
    slow = replace(
        cost, rates=replace(saved.rates, weight_bytes_per_s=saved.rates.weight_bytes_per_s / 2)
    )
    worst = 0.0
    for r in rows:
        if r["role"] == "step":
            continue
        assert 1e3 * role_time(cost, r) == pytest.approx(r["fitted_ms"], rel=1e-6), r
        worst = max(worst, abs(1e3 * role_time(slow, r) / r["measured_ms"] - 1))
    assert worst > ROLE_ERROR, f"halving the weights' read moved no role by {ROLE_ERROR:.0%}"

    plan = subprocess.run(
        [*command[:-3], "--profile", str(profile), "--json"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr[-4000:]
    planned = json.loads(plan.stdout)
    assert planned["rates"] == saved.rates.source and planned["afd_over_colocated"] > 0, planned


def role_time(cost: CostModel, row: dict) -> float:
    if row["role"] == "attention":
        return cost.attention(row["batch"], row["context"])
    return cost.ffn(row["batch"], row["batch"], 1)
