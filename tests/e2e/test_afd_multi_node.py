"""AFD across hosts, launched with vLLM's own multi-node flags.

Four "hosts" are network namespaces the test makes, each with one address
on a bridge of their own (nothing is added to the machine's own network):

- head: `vllm serve --data-parallel-size 2 --data-parallel-size-local 1
  --data-parallel-address HEAD`, the API server and attention rank 0;
- headless: the same with `--headless --data-parallel-start-rank 1`,
  attention rank 1;
- ffn: `vllm afd-ffn`, the FFN rank for both, listening on its own address;
- spare: a host for a standby FFN rank (the failover test).

The AFD config names the FFN host; a routable address needs the shared
secret, given as a file on the FFN host and in the environment on the
attention hosts. Concurrent requests to the head are answered by both
ranks (the FFN rank's /metrics counts tokens per attention rank) with
greedy tokens equal to stock colocated vLLM's. A killed host (every process
in its namespace SIGKILLed) ends the deployment within ``timeout_s``, with
errors that name the lost peer. With ``failover_timeout_s`` the FFN host
may die (every process killed) while requests are decoding, and a
replacement started on it takes over; or vanish (its link down: nothing
closes), and a standby on the spare host takes over once the FFN rank's
address (a virtual IP) moves there; then the spare host dies, and a
replacement at the FFN host's own address, one of the attention ranks'
``failover_hosts``, takes over. The answers still equal stock's.

Needs root (network namespaces); CI runs as root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import PROMPTS
from vllm_afd_dev.harness.launch import TOOK_OVER, VLLM_CLI, failure_report
from vllm_afd_dev.harness.net_hosts import Hosts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

TIMEOUT_S = 20
"""The deployment's ``timeout_s``: a lost peer must end it within this (plus
vLLM's own shutdown)."""
SERVE_PORT, RPC_PORT, AFD_PORT, METRICS_PORT = 8000, 13345, 29650, 9400
ENGINE = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "512")

# A client run inside a namespace: the standard prompts at once, greedy,
# argv[4] tokens each; prints each answer's token ids.
CLIENT = """
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, model, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def complete(prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": int(sys.argv[4]), "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as reply:
        return json.loads(reply.read())["choices"][0]["token_ids"]
with ThreadPoolExecutor(len(prompts)) as pool:
    print(json.dumps(list(pool.map(complete, prompts))))
"""
GET = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except OSError as e:
    sys.exit(f"{sys.argv[1]}: {e}")
"""
TOKENS_SAMPLE = "vllm_afd_ffn_tokens_total"
"""The FFN rank's tokens run, per attention rank, in its /metrics."""
# Run inside a namespace: polls /metrics (argv[1]) every 50 ms until the
# samples named argv[2] sum to more than argv[3]; fails after argv[4] s.
WAIT_FOR_TOKENS = """
import sys, time, urllib.request
from prometheus_client.parser import text_string_to_metric_families
url, name, more_than = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + float(sys.argv[4])
while time.monotonic() < deadline:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        text = ""
    families = text_string_to_metric_families(text)
    if sum(s.value for f in families for s in f.samples if s.name == name) > more_than:
        sys.exit(0)
    time.sleep(0.05)
sys.exit(f"{url}: the FFN rank ran no more than {more_than:.0f} tokens within {sys.argv[4]} s")
"""


@pytest.fixture
def hosts():
    made = Hosts()
    yield made
    made.close()


class Deployment:
    """The three roles on their hosts, logging under ``tmp``."""

    def __init__(
        self,
        hosts: Hosts,
        model: Path,
        tmp: Path,
        ffn_address: str | None = None,
        **afd_extra: object,
    ) -> None:
        """``ffn_address``: where the attention ranks reach the FFN rank (by
        default the FFN host's own address)."""
        self.hosts, self.model, self.tmp = hosts, model, tmp
        head = hosts.address["head"]
        self.ffn_address = ffn = ffn_address or hosts.address["ffn"]
        secret = tmp / "secret"
        secret.write_text("a secret shared by the test's hosts\n")
        secret.chmod(0o600)
        afd = {"host": ffn, "port": AFD_PORT, "num_attention_ranks": 2, "timeout_s": TIMEOUT_S,
               **afd_extra}  # fmt: skip
        self.ffn_afd = {**afd, "role": "ffn", "secret_file": str(secret),
                        "metrics_port": METRICS_PORT}  # fmt: skip
        dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
              "--data-parallel-address", head, "--data-parallel-rpc-port", str(RPC_PORT),
              "--afd-config", json.dumps(afd)]  # fmt: skip
        secret_env = {"VLLM_AFD_SECRET": secret.read_text()}
        self.procs = {
            "ffn": self.start_ffn("ffn"),
            "head": hosts.start(
                "head", [*VLLM_CLI, "serve", str(model), *ENGINE, *dp, "--host", head,
                         "--port", str(SERVE_PORT), "--shutdown-timeout", "30"],
                self.log("head"), **secret_env,
            ),
            "headless": hosts.start(
                "headless", [*VLLM_CLI, "serve", str(model), *ENGINE, *dp, "--headless",
                             "--data-parallel-start-rank", "1"],
                self.log("headless"), **secret_env,
            ),
        }  # fmt: skip
        self.url = f"http://{head}:{SERVE_PORT}"

    def start_ffn(self, log_name: str, on: str = "ffn", **afd: object) -> subprocess.Popen:
        """`vllm afd-ffn` on host ``on``, logging to ``log_name``."""
        cmd = [*VLLM_CLI, "afd-ffn", str(self.model), *ENGINE, "--afd-config",
               json.dumps({**self.ffn_afd, **afd})]  # fmt: skip
        return self.hosts.start(on, cmd, self.log(log_name))

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def report(self) -> str:
        return "\n".join(f"== {n}\n{failure_report(self.log(n).read_text())}" for n in self.procs)

    def wait_until_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            ended = [n for n, p in self.procs.items() if p.poll() is not None]
            assert not ended and time.monotonic() < deadline, f"{ended}\n{self.report()}"
            proc = subprocess.run(
                ["ip", "netns", "exec", self.hosts.ns["head"], sys.executable, "-c", GET,
                 self.url + "/health"], capture_output=True, timeout=30,
            )  # fmt: skip
            if proc.returncode == 0:
                return
            time.sleep(2)

    def generate(self, max_tokens: int = 24) -> list[list[int]]:
        out = self.hosts.python("head", CLIENT, self.url, str(self.model), json.dumps(PROMPTS),
                                str(max_tokens), timeout=600)  # fmt: skip
        return json.loads(out)

    @property
    def ffn_metrics_url(self) -> str:
        return f"http://{self.ffn_address}:{METRICS_PORT}/metrics"

    def wait_for_ffn_tokens(self, more_than: int, timeout_s: float = 120) -> None:
        """Return once the FFN rank has run more than ``more_than`` tokens.
        One poller in the head's namespace reads /metrics every 50 ms, so
        the caller acts within a step or two of it; a Python start-up per
        read lags by a second or more on a loaded machine, which a short
        generation can outrun."""
        self.hosts.python("head", WAIT_FOR_TOKENS, self.ffn_metrics_url, TOKENS_SAMPLE,
                          str(more_than), str(timeout_s), timeout=timeout_s + 30)  # fmt: skip

    def ffn_tokens_per_rank(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.hosts.python("head", GET, self.ffn_metrics_url)
        return {
            s.labels["attention_rank"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == TOKENS_SAMPLE
        }

    def wait_for_exits(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            try:
                self.procs[name].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still runs {timeout_s:.0f} s after the kill\n{self.report()}")


def test_attention_hosts_and_an_ffn_host_match_stock_until_the_ffn_host_dies(
    hosts, tiny_qwen3, colocated, tmp_path
):
    deployment = Deployment(hosts, tiny_qwen3, tmp_path)
    deployment.wait_until_healthy()
    tokens = deployment.generate()
    served = deployment.ffn_tokens_per_rank()
    assert served["0"] > 0 and served["1"] > 0, served
    assert tokens == colocated(tiny_qwen3)["tokens"]

    hosts.kill("ffn")
    # vLLM's own shutdown follows the lost rank's error (up to its 30 s).
    deployment.wait_for_exits(["head", "headless"], TIMEOUT_S + 60)
    lost = f"lost the FFN rank at {hosts.address['ffn']}:{AFD_PORT}"
    for name in ("head", "headless"):
        assert lost in deployment.log(name).read_text(), deployment.report()


def test_a_killed_headless_host_ends_the_deployment_naming_its_rank(hosts, tiny_qwen3, tmp_path):
    deployment = Deployment(hosts, tiny_qwen3, tmp_path)
    deployment.wait_until_healthy()
    hosts.kill("headless")
    deployment.wait_for_exits(["ffn", "head"], TIMEOUT_S + 60)
    ffn_log = deployment.log("ffn").read_text()
    assert "attention rank(s) [1] disconnected" in ffn_log, deployment.report()
    assert deployment.procs["ffn"].returncode != 0
    assert "attention rank(s) [1] disconnected" in deployment.log("head").read_text()


def test_the_ffn_host_killed_then_vanished_is_replaced_and_no_answer_changes(
    hosts, tiny_qwen3, tmp_path
):
    """2A1F across hosts with failover, while 6 requests decode; the
    attention ranks reach the FFN rank at a service address (a virtual IP)
    on the FFN host. The FFN host dies (its processes killed: the attention
    hosts see its connections close) and a replacement starts on it. Then
    that host vanishes (its link down: the attention hosts' transfers stall
    until ``timeout_s``) and the service address moves to a spare host,
    where a standby has waited for it. Then the spare host dies and the FFN
    host comes back, its replacement at the host's own address, which the
    attention ranks find among their ``failover_hosts``. Every answer
    equals stock's."""
    from vllm_afd_dev.harness.generate import run

    # Long enough that the decode outlasts the first replacement's takeover
    # by more than the unplug takes on a loaded 2-core machine.
    max_tokens = 320
    reference = run(tiny_qwen3, stock=True, max_tokens=max_tokens)["tokens"]
    service = hosts.service_address
    hosts.add_address("ffn", service)
    own_address = hosts.address["ffn"]
    deployment = Deployment(hosts, tiny_qwen3, tmp_path, ffn_address=service,
                            failover_timeout_s=300, failover_hosts=[own_address])  # fmt: skip
    deployment.wait_until_healthy()
    deployment.procs["standby"] = deployment.start_ffn("standby", on="spare", standby=True)
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(deployment.generate(max_tokens)))

    def wait_for(done: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if client.ident is not None:
                assert client.is_alive(), f"the requests ended before {what}\n{deployment.report()}"
            assert time.monotonic() < deadline, f"no {what}\n{deployment.report()}"
            time.sleep(0.2)

    def logged(name: str, text: str) -> int:
        return deployment.log(name).read_text().count(text)

    # Loaded and checked against the FFN rank it backs, it waits for the
    # service address to come to its host.
    wait_for(lambda: logged("standby", "waiting to take the place of the FFN rank") == 1,
             "standby ready")  # fmt: skip
    assert logged("standby", f"it can take the place of the FFN rank on {service}") == 1
    client.start()
    deployment.wait_for_ffn_tokens(300)  # mid-decode: 117 prompt tokens, 1920 to generate
    hosts.kill("ffn")
    deployment.start_ffn("ffn-2")
    wait_for(lambda: logged("head", TOOK_OVER) == 1, "first replacement")
    hosts.unplug("ffn")
    waiting = "Keeping this rank's requests and KV cache"
    wait_for(lambda: logged("head", waiting) == 2, "second loss", timeout_s=TIMEOUT_S + 60)
    hosts.move_address(service, "ffn", "spare")
    wait_for(lambda: logged("head", TOOK_OVER) == 2, "the standby taking over")
    hosts.kill("spare")
    hosts.kill("ffn")  # what its stalled FFN rank left: the host is rebuilt
    hosts.plug("ffn")
    deployment.procs["ffn-3"] = deployment.start_ffn("ffn-3", host=own_address)
    client.join(timeout=600)
    assert answers == [reference], deployment.report()
    for name in ("head", "headless"):
        assert logged(name, TOOK_OVER) == 3, deployment.report()
        assert logged(name, f"lost the FFN rank at {service}:{AFD_PORT}") >= 2
    took_over = "AFD ffn rank 0 connected over gloo (FFN rank 0, attention peers [0, 1])"
    assert logged("standby", took_over) == 1, deployment.report()
    assert logged("ffn-3", took_over) == 1, deployment.report()
