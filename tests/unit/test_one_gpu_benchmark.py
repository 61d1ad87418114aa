"""The one-GPU overlap benchmark's arithmetic (benchmarks/afd_one_gpu_overlap.py):
its roofline bound (vllm_afd_dev.bench.roofline) on the shapes it times, and
the host profile's sorting of py-spy samples (vllm_afd_dev.bench.host_profile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_afd_dev.bench.host_profile import host_share
from vllm_afd_dev.bench.roofline import bound, role_work
from vllm_afd_dev.bench.shapes import QWEN3_8B, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS

DENSE = QWEN3_8B
MOE = dict(QWEN3_30B_A3B, num_hidden_layers=QWEN3_30B_A3B_LAYERS)


def test_role_work_counts_weights_kv_and_flops():
    attention, ffn = role_work(DENSE, batch=10, context=100)
    mlp = 36 * 3 * 4096 * 12288
    assert ffn.bytes == 2 * mlp and ffn.flops == 2 * mlp * 10
    # The KV cache read grows with batch x context; the weights do not.
    longer, _ = role_work(DENSE, batch=10, context=200)
    kv_per_token = 2 * 36 * 2 * 8 * 128
    assert longer.bytes - attention.bytes == pytest.approx(10 * 100 * kv_per_token)
    # Each stage reads the weights again.
    _, two = role_work(DENSE, batch=10, context=100, stages=2)
    assert two.bytes == 2 * ffn.bytes and two.flops == ffn.flops


def test_the_bound_is_above_one_only_where_a_bandwidth_role_meets_a_compute_role():
    assert bound(DENSE, 1024, 512, stages=1) == 1.0  # no stages: the roles take turns
    # A dense FFN at 1024 tokens is compute-bound, attention over 512K cached
    # tokens bandwidth-bound: room to overlap.
    assert bound(DENSE, 1024, 512, stages=2) > 1.2
    # A MoE FFN reads its experts at any batch here; a stage reads them again.
    assert bound(MOE, 128, 512, stages=2) < 0.6
    assert bound(MOE, 128, 512, stages=3) < bound(MOE, 128, 512, stages=2)


def _profile(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "profile.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


LOOP = "thread (1): MainThread;EngineCore.run_busy_loop (vllm/v1/engine/core.py:900)"
WRAPPED = f"{LOOP};afd_step.<locals>.step (vllm/distributed/afd_transfer/afd_transfer_state.py:60)"


def test_host_samples_are_split_into_gpu_waits_vllm_and_afd_code(tmp_path):
    share = host_share(_profile(tmp_path, [
        f"{WRAPPED};AsyncGPUModelRunnerOutput.get_output (x.py:316);Event.synchronize (t.py:2) 50",
        f"{WRAPPED};Scheduler.schedule (vllm/v1/core/sched/scheduler.py:564) 30",
        f"{WRAPPED};AttentionEndpoint.publish_step (endpoint/attention.py:1);"
        "ControlPayload.encode (vllm/distributed/afd_transfer/control.py:9) 4",
        f"{LOOP};EngineCore._process_input_queue (core.py:1);Condition.wait (threading.py:1) 7",
        "thread (2): afd-watchdog;ControlConnectionWatchdog._run (vllm/afd/x.py:55) 99",
    ]))  # fmt: skip
    assert (share.gpu_wait, share.host, share.afd, share.idle) == (50, 34, 4, 7)
    assert share.host_fraction == pytest.approx(34 / 84)
    assert share.top_host_leaves[0] == ("Scheduler.schedule", pytest.approx(30 / 84))


def test_a_profile_without_the_engine_loop_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no samples of the engine core's loop"):
        host_share(_profile(tmp_path, ["thread (1): MainThread;<module> (x.py:1) 5"]))
