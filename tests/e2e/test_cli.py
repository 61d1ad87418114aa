"""`vllm serve` and `vllm bench` run AFD with --afd-config: one command starts
the attention engine and (spawn_ffn) its FFN rank, on the tiny model, offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import free_port, worker_env
from vllm_afd_dev.harness.launch import (
    complete,
    failure_report,
    ffn_server,
    http_get,
    scrape,
    scrape_until,
    serve,
    stop,
    total,
    wait_until_healthy,
)

VLLM = str(Path(sys.executable).with_name("vllm"))
"""The `vllm` script the wheel installs, as a user runs it."""
ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
          "--gpu-memory-utilization", "0.3"]  # fmt: skip


def afd(**config: object) -> list[str]:
    return ["--afd-config", json.dumps({"spawn_ffn": True, "port": free_port(), **config})]


def get(port: int, path: str) -> tuple[int, str]:
    return http_get(f"127.0.0.1:{port}", path)


def sent_tokens(samples: dict) -> float:
    return total(samples, "vllm:afd_tokens_total")


def test_bench_rejects_a_bad_afd_config_before_starting(tiny_qwen3):
    proc = subprocess.run(
        [VLLM, "bench", "latency", "--model", str(tiny_qwen3),
         "--afd-config", '{"num_attention_ranks": 3, "num_ffn_ranks": 2}'],
        capture_output=True, text=True, env=worker_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "topology 3A:2F is invalid" in proc.stderr


def test_bench_latency_with_afd_config(tiny_qwen3, tmp_path):
    out = tmp_path / "latency.json"
    proc = subprocess.run(
        [VLLM, "bench", "latency", "--model", str(tiny_qwen3), *ENGINE, *afd(),
         "--input-len", "16", "--output-len", "8", "--batch-size", "2",
         "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out)],
        capture_output=True, text=True, env=worker_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, failure_report(proc.stderr)
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0


def test_bench_throughput_with_afd_config(tiny_qwen3, tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [VLLM, "bench", "throughput", "--model", str(tiny_qwen3), *ENGINE, *afd(),
         "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "4",
         "--output-json", str(out)],
        capture_output=True, text=True, env=worker_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, failure_report(proc.stderr)
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4 and result["tokens_per_second"] > 0


def test_serve_with_afd_answers_and_shuts_down_with_its_ffn_rank(tiny_qwen3, tmp_path):
    """Also scrapes the spawned FFN rank's /health and /metrics and the API
    server's /metrics (its attention engine's ``vllm:afd_*`` counters) around
    one request, with ``time_steps``, so the step times fill too."""
    port, metrics_port, log = free_port(), free_port(), tmp_path / "serve.log"
    ffn_config = afd(metrics_port=metrics_port, time_steps=True)
    # A shutdown timeout lets the engine tell its FFN rank to stop; with the
    # default 0, vLLM may kill the engine first (README).
    server = serve(tiny_qwen3, port, log, *ENGINE, *ffn_config, "--shutdown-timeout", "30")
    try:
        server = wait_until_healthy(server, port, log)
        assert get(metrics_port, "/health") == (200, "serving\n")
        before = scrape(metrics_port, "vllm_afd_ffn_")
        attention_before = scrape(port, "vllm:afd_")
        answer = complete(port, tiny_qwen3, "The attention side runs")
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["text"]
        after = scrape(metrics_port, "vllm_afd_ffn_")
        attention_after = scrape_until(
            port, "vllm:afd_", lambda samples: sent_tokens(samples) > sent_tokens(attention_before)
        )
    finally:
        stop(server)
    text = log.read_text()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"ffn_rank": "0", **labels}.items())))
        return after[key] - before.get(key, 0)

    # The request's tokens crossed the FFN rank once each: its prompt, then
    # every generated token but the last, one eager step each (--enforce-eager).
    usage = answer["usage"]
    tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert grew("vllm_afd_ffn_tokens_total", attention_rank="0") == tokens
    assert grew("vllm_afd_ffn_steps_total", kind="eager") == usage["completion_tokens"]
    # a step's times are read as the next step begins: the last is pending
    assert grew("vllm_afd_ffn_step_compute_seconds_count") == usage["completion_tokens"] - 1
    assert grew("vllm_afd_ffn_step_exchange_seconds_sum") > 0
    assert after[("vllm_afd_ffn_peers_connected", (("ffn_rank", "0"),))] == 1

    # The attention engine's own view, through vLLM's stats path: it sent what
    # the FFN rank received, and announced the steps the FFN rank ran (its
    # counters appear with its first served step, holding the start-up steps).
    def attention_grew(name: str, **labels: str) -> float:
        return total(attention_after, name, engine="0", **labels) - total(
            attention_before, name, engine="0", **labels
        )

    assert attention_grew("vllm:afd_tokens_total") == tokens
    for kind in ("eager", "replay", "capture"):
        assert (
            total(attention_after, "vllm:afd_steps_total", kind=kind)
            == after[("vllm_afd_ffn_steps_total", (("ffn_rank", "0"), ("kind", kind)))]
        )
    assert attention_grew("vllm:afd_timed_steps_total") == usage["completion_tokens"] - 1
    assert attention_grew("vllm:afd_exchange_seconds_total") > 0
    assert attention_grew("vllm:afd_compute_seconds_total") > 0
    weights = after[("vllm_afd_ffn_weight_bytes", (("ffn_rank", "0"),))]
    assert f"the FFN of 2 layers, {int(weights)} bytes" in text
    assert "AFD FFN rank 0: shutdown after" in text, text[-4000:]
    assert "KeyboardInterrupt" not in text, text[-4000:]


CORES = f"{min(os.sched_getaffinity(0))}-{max(os.sched_getaffinity(0))}"


@pytest.mark.parametrize("binding", ["nobind", CORES], ids=["in-process", "bound-child"])
def test_ctrl_c_stops_a_hand_started_ffn_rank_with_one_line(binding, tiny_qwen3, tmp_path):
    """SIGINT to the `vllm afd-ffn` process alone, as `kill -INT` sends it:
    with its threads bound (vLLM's default on CPU) the rank runs in a child,
    to which the server passes it on. And, while it waits for its peers, its
    /health says so with a 503."""
    port, metrics_port, log = free_port(), free_port(), tmp_path / "ffn.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": binding}
    ffn = ffn_server(tiny_qwen3, port, log, env=env, metrics_port=metrics_port)
    try:
        deadline = time.monotonic() + 300
        while "waiting for attention ranks" not in log.read_text():
            assert ffn.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert get(metrics_port, "/health") == (503, "waiting for attention peers\n")
        ffn.send_signal(signal.SIGINT)
        assert ffn.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        ffn.kill()
    text = log.read_text()
    assert "AFD FFN rank 0, group rank 0: interrupted, stopped" in text
    assert "Traceback" not in text, text[-3000:]


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited orphan may stay a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ffn_processes_end_with_a_killed_server(tiny_qwen3, tmp_path):
    """SIGKILL on `vllm afd-ffn` (threads bound, so the rank runs in a child):
    the child notices that its server is gone and exits with a line saying
    so, instead of serving on as an orphan that a replacement would meet."""
    port, log = free_port(), tmp_path / "ffn.log"
    ffn = ffn_server(tiny_qwen3, port, log, env={"VLLM_CPU_OMP_THREADS_BIND": CORES})
    try:
        deadline = time.monotonic() + 300
        while "waiting for attention ranks" not in log.read_text():
            assert ffn.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        children = [
            int(pid)
            for task in Path(f"/proc/{ffn.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        assert children, "the bound FFN rank should run in a child of the server"
        ffn.kill()
        ffn.wait()
        deadline = time.monotonic() + 30
        while any(map(running, children)):
            assert time.monotonic() < deadline, f"orphaned FFN processes {children} still run"
            time.sleep(0.5)
    finally:
        ffn.kill()
    assert f"its server (pid {ffn.pid}) is gone; exiting" in log.read_text()
