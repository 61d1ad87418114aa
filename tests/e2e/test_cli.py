"""`vllm serve` and `vllm bench` run AFD with --afd-config: one command starts
the attention engine and (spawn_ffn) its FFN rank, on the tiny model, offline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

VLLM = str(Path(sys.executable).with_name("vllm"))
ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
          "--gpu-memory-utilization", "0.3"]  # fmt: skip


@pytest.fixture(scope="module")
def env():
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # nothing may come from a hub
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def afd() -> list[str]:
    return ["--afd-config", json.dumps({"spawn_ffn": True, "port": free_port()})]


def test_bench_rejects_a_bad_afd_config_before_starting(env, tiny_qwen3):
    proc = subprocess.run(
        [VLLM, "bench", "latency", "--model", str(tiny_qwen3),
         "--afd-config", '{"num_attention_ranks": 3, "num_ffn_ranks": 2}'],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "topology 3A:2F is invalid" in proc.stderr


def test_bench_latency_with_afd_config(env, tiny_qwen3, tmp_path):
    out = tmp_path / "latency.json"
    proc = subprocess.run(
        [VLLM, "bench", "latency", "--model", str(tiny_qwen3), *ENGINE, *afd(),
         "--input-len", "16", "--output-len", "8", "--batch-size", "2",
         "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0


def test_bench_throughput_with_afd_config(env, tiny_qwen3, tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [VLLM, "bench", "throughput", "--model", str(tiny_qwen3), *ENGINE, *afd(),
         "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "4",
         "--output-json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4 and result["tokens_per_second"] > 0


def test_serve_with_afd_answers_and_shuts_down_with_its_ffn_rank(env, tiny_qwen3, tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [VLLM, "serve", str(tiny_qwen3), *ENGINE, *afd(), "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        body = json.dumps(
            {
                "model": str(tiny_qwen3),
                "prompt": "The attention side runs",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
        )
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["text"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            assert server.wait(timeout=60) is not None
        finally:
            if server.poll() is None:
                server.kill()
            log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "AFD FFN rank 0: shutdown after" in text, text[-4000:]
