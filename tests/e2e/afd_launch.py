"""Launch helpers shared by the AFD end-to-end tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from generate import worker_env

VLLM = str(Path(sys.executable).with_name("vllm"))


def ffn_server(
    model: Path, port: int, log: Path, timeout_s: float = 180, **topology: int
) -> subprocess.Popen:
    """`vllm afd-ffn` on its own, as a user starts it on the FFN side."""
    afd = {"role": "ffn", "port": port, "timeout_s": timeout_s, **topology}
    cmd = [VLLM, "afd-ffn", str(model), "--dtype", "float32", "--enforce-eager",
           "--afd-config", json.dumps(afd)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=worker_env())


def attention_args(port: int, timeout_s: float = 180, **topology: int) -> dict:
    return {"afd_config": {"port": port, "timeout_s": timeout_s, **topology}}


def serve(model: Path, port: int, log: Path, *args: str) -> subprocess.Popen:
    """`vllm serve MODEL ARGS` on 127.0.0.1:port, logging to ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen(
            [VLLM, "serve", str(model), *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, env=worker_env(),
        )  # fmt: skip


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path, timeout_s=400) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)


def complete(port: int, model: Path, prompt: str, max_tokens: int = 8) -> dict:
    """One greedy /v1/completions request."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def stop(server: subprocess.Popen, timeout_s: float = 90) -> int:
    """Ctrl-C, as a user stops `vllm serve`; kill only if it does not exit."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.kill()
