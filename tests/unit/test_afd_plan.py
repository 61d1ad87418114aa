"""``vllm afd-plan`` (vllm.afd.plan): shapes, the cost model's response to
obvious changes, the search, the fit of calibration on synthetic and on
stored measurements, the profile's round trip, and the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from vllm.afd.plan.calibrate import RoleSample, fit_rates
from vllm.afd.plan.calibration_budget import MARGIN, calibration_budget
from vllm.afd.plan.cost import CostModel
from vllm.afd.plan.hardware import PRESETS
from vllm.afd.plan.measure import DECODE_TOKENS, DEFAULT_POINTS
from vllm.afd.plan.rates import Profile, Rates
from vllm.afd.plan.search import Target, largest_batch, plan
from vllm.afd.plan.shapes import NAMED, layers_override, load_shape

from vllm_afd_dev.bench.results import RESULTS


def model(name: str = "qwen3-30b-a3b", gpu: str = "H200", **rates) -> CostModel:
    shape, spec = load_shape(name), PRESETS[gpu]
    dtype = "fp8" if shape.weight_bytes == 1 else "bf16"
    return CostModel(shape, spec, replace(Rates.roofline(spec, dtype), **rates))


def test_every_named_shape_loads_with_plausible_sizes():
    billions = {
        "qwen3-30b-a3b": 30.5,
        "qwen3-235b-a22b": 235,
        "deepseek-v3": 671,
        "minimax-m2.5": 229,
        "mixtral-8x22b": 141,
    }
    for name in NAMED:
        shape = load_shape(name)
        total = (
            shape.attention_params
            + shape.replicated_ffn_params
            + shape.routed_params
            + 2 * shape.embedding_params
        ) / 1e9
        if name in billions:  # within 10% of the published parameter count
            assert total == pytest.approx(billions[name], rel=0.1), name


def test_a_local_config_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(NAMED["deepseek-v3"]))
    assert load_shape(str(tmp_path)) == replace(load_shape("deepseek-v3"), name=str(tmp_path))
    with pytest.raises(ValueError, match="neither a named shape"):
        load_shape(str(tmp_path / "missing"))


def test_largest_batch_bisects_to_the_tpot():
    cost = model()
    b, step = largest_batch(lambda b: cost.colocated_step(8, b, 2048), 4096, 0.030)
    assert step.total <= 0.030 < cost.colocated_step(8, b + 1, 2048).total


def test_a_plan_is_finite_and_its_options_meet_the_target():
    result = plan(model(), Target(gpus=8, tpot_s=0.05, context=2048))
    options = [*result.afd.values(), result.colocated]
    assert all(o is not None for o in options)
    for o in options:
        assert 0 < o.step.total <= 0.05 and math.isfinite(o.tok_s_per_gpu) and o.tok_s_per_gpu > 0
        assert all(v >= 0 and math.isfinite(v) for v in o.step.terms.values())
    assert result.ratio > 0 and result.closed_form_ratio > 0


def best_split(cost: CostModel, target: Target) -> float:
    """A / F of the best serial AFD option."""
    o = plan(cost, replace(target, stages=(1,))).afd[1]
    return o.attention_gpus / o.ffn_gpus


def test_the_split_follows_the_work_of_each_role():
    target = Target(gpus=16, tpot_s=0.1, context=1024)
    base = best_split(model(), target)
    # Longer contexts give attention more work: more attention GPUs.
    assert best_split(model(), replace(target, context=8192)) >= base
    # Slower expert reads give the FFN more work: more FFN GPUs.
    slow = model()
    slow = replace(slow, rates=replace(slow.rates, ffn_layer_s=slow.rates.ffn_layer_s * 20))
    assert best_split(slow, target) <= base


def test_faster_hardware_never_slows_a_deployment():
    target = Target(gpus=8, tpot_s=0.05, context=2048)
    base = plan(model(), target)
    cost = model()
    faster = replace(
        cost, gpu=cost.gpu.with_overrides(link_bytes_per_s=4 * cost.gpu.link_bytes_per_s)
    )
    quick = plan(faster, target)
    assert quick.best_afd.tok_s_per_gpu >= base.best_afd.tok_s_per_gpu
    assert quick.colocated.tok_s_per_gpu >= base.colocated.tok_s_per_gpu
    more = plan(model(weight_bytes_per_s=2 * cost.rates.weight_bytes_per_s), target)
    assert more.colocated.tok_s_per_gpu > base.colocated.tok_s_per_gpu


def test_expert_parallelism_costs_an_all_to_all_that_grows_off_the_node():
    cost = model("deepseek-v3")
    assert cost.all_to_all(64, 1) == 0
    inside, across = cost.all_to_all(64, 8), cost.all_to_all(64, 16)
    assert 0 < inside < across  # 16 GPUs span two HGX nodes: the NICs carry part of it


def synthetic_samples(cost: CostModel) -> list[RoleSample]:
    points = [(1, 512), (8, 2048), (64, 512), (256, 1024)]
    return [
        RoleSample(
            b,
            c,
            cost.attention(b, c),
            cost.ffn(b, b, 1),
            cost.shape.layers * cost.rates.shared_gpu_exchange_layer_s,
            cost.shared_gpu_afd_step(b, c),
        )
        for b, c in points
    ]


def test_calibration_recovers_the_rates_that_made_its_measurements():
    true = model(
        weight_bytes_per_s=3.1e12,
        kv_bytes_per_s=4.2e12,
        flops=6e14,
        attention_layer_s=33e-6,
        attention_seq_layer_s=0.5e-6,
        ffn_layer_s=21e-6,
        tail_s=0.3e-3,
        shared_gpu_exchange_layer_s=15e-6,
    )
    rates, rows = fit_rates(model(), synthetic_samples(true), "synthetic")
    for name in (
        "weight_bytes_per_s",
        "kv_bytes_per_s",
        "flops",
        "attention_layer_s",
        "attention_seq_layer_s",
        "ffn_layer_s",
        "tail_s",
        "shared_gpu_exchange_layer_s",
    ):
        assert getattr(rates, name) == pytest.approx(getattr(true.rates, name), rel=1e-6), name
    assert all(abs(r.error) < 1e-9 for r in rows)


def test_a_profile_round_trips_and_refuses_another_version(tmp_path):
    rates, rows = fit_rates(model(), synthetic_samples(model()), "synthetic")
    profile = Profile("NVIDIA H200", "qwen3-30b-a3b", rates, [{"batch": 1}])
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    data = json.loads((tmp_path / "p.json").read_text()) | {"version": 0}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="calibrate again"):
        Profile.load(tmp_path / "p.json")


def test_calibration_on_the_stored_h200_runs_predicts_the_one_gpu_steps():
    """Fitted to the 48-layer Qwen3-30B-A3B role times on one H200, the
    planner's rates predict the one-GPU 1A1F decode steps that took no part
    in the fit (benchmarks/afd_gpu_decode.py), batch 8-256 within 10%;
    batch 1 is printed (the FFN's fixed cost per layer, which saturated
    points cannot show)."""
    role_file = json.loads((RESULTS / "afd_one_gpu_overlap_qwen3-30b-a3b.json").read_text())
    steps = json.loads((RESULTS / "afd_gpu_decode_qwen3-30b-a3b.json").read_text())
    rates, rows = fit_rates(model(), RoleSample.from_benchmark(role_file), "stored")
    fitted = replace(model(), rates=rates)
    context = 16 + steps["decode_tokens"] / 2  # benchmarks/decode_timing.py's short prompts
    errors = {}
    for b, ms in steps["ms_per_output_token"]["AFD graphs, MPS on"].items():
        measured = sum(ms) / len(ms)
        errors[int(b)] = 1e3 * fitted.shared_gpu_afd_step(int(b), context) / measured - 1
        print(f"batch {b:>4}: predicted / measured - 1 = {errors[int(b)]:+.1%}")
    assert all(abs(e) < 0.10 for b, e in errors.items() if b >= 8)
    assert all(abs(r.error) < 0.05 for r in rows if r.role != "step")


GIB = 2**30


def qwen3_30b_budget(total_gib: float, layers: int | None = None, points=DEFAULT_POINTS):
    """Qwen3-30B-A3B's calibration on an idle GPU of ``total_gib``."""
    total = int(total_gib * GIB)
    return calibration_budget(
        lambda n: load_shape("qwen3-30b-a3b", n),
        points,
        DECODE_TOKENS,
        total - GIB // 2,  # the driver's own
        total,
        layers,
    )


def test_a_cut_shape_scales_every_per_layer_quantity():
    whole, cut = load_shape("qwen3-30b-a3b"), load_shape("qwen3-30b-a3b", 12)
    assert cut.layers == 12 and cut.moe_layers == 12
    for field in ("attention_params", "kv_bytes_per_token", "routed_params"):
        assert getattr(cut, field) == pytest.approx(getattr(whole, field) / 4), field
    assert (cut.hidden, cut.vocab, cut.experts) == (whole.hidden, whole.vocab, whole.experts)
    vision = {"text_config": dict(NAMED["qwen3-30b-a3b"]), "vision_config": {}}
    assert layers_override(vision, 12) == {"text_config": {"num_hidden_layers": 12}}
    assert layers_override(NAMED["qwen3-30b-a3b"], 12) == {"num_hidden_layers": 12}


def test_calibration_takes_the_deepest_model_that_fits_beside_its_ffn_rank():
    # On an 80 GB H100 the 48 layers' experts and the points' KV cache do
    # not fit together (the first GPU run of --calibrate failed in vLLM's
    # start-up check): the run is cut, as deep as fits, and no deeper.
    h100 = qwen3_30b_budget(79.18)
    available = (79.18 - 0.5 - MARGIN * 79.18) * GIB
    assert 1 < h100.layers < 48 and h100.model_layers == 48
    assert h100.ffn_bytes + h100.attention_bytes <= available
    one_more = qwen3_30b_budget(200.0, h100.layers + 1)
    assert one_more.ffn_bytes + one_more.attention_bytes > available
    # The attention engine's share is its own need, not vLLM's 0.92 of the GPU.
    assert h100.gpu_memory_utilization == pytest.approx(
        h100.attention_bytes / (79.18 * GIB), abs=0.01
    )
    assert h100.kv_cache_memory_bytes < h100.attention_bytes
    assert f"{h100.layers} of 48 layers" in h100.describe()
    assert qwen3_30b_budget(139.8).layers == 48  # an H200 holds it whole


def test_calibration_refuses_a_depth_or_points_that_cannot_fit():
    with pytest.raises(ValueError, match="--calibrate-layers 48 does not fit this GPU"):
        qwen3_30b_budget(79.18, 48)
    with pytest.raises(ValueError, match="the model has 48 decoder layers"):
        qwen3_30b_budget(139.8, 60)
    with pytest.raises(ValueError, match="not even one layer"):
        qwen3_30b_budget(79.18, points=((4096, 131072),))


def test_the_cli_plans_and_prints_json(capsys):
    import argparse

    from vllm.entrypoints.cli.afd_plan import AFDPlanSubcommand

    parser = argparse.ArgumentParser()
    AFDPlanSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(
        [
            "afd-plan",
            "--model",
            "qwen3-30b-a3b",
            "--gpus",
            "4",
            "--json",
            "--hbm-tbps",
            "4.0",
            "--stages",
            "1",
            "2",
        ]
    )
    AFDPlanSubcommand.cmd(args)
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 4 and set(out["afd"]) == {"1", "2"}
    assert out["afd_over_colocated"] > 0
