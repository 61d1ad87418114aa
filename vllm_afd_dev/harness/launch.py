"""Launch helpers of the AFD end-to-end and GPU tests and the benchmarks:
hand-started FFN ranks, `vllm serve`, kills mid-generation, metrics, the
tensor-parallel test placement on one GPU, streaming completions."""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from vllm.afd.models.weight_roles import is_ffn_weight
from vllm.distributed.afd_transfer.step_stats import StepRecord
from vllm.model_executor.model_loader.ep_weight_filter import parse_expert_id

from vllm_afd_dev.bench.gpu_memory import checkpoint_tensor_bytes, text_config
from vllm_afd_dev.harness.generate import (
    ENGINE_ARGS,
    GenerationError,
    failure_report,
    free_port,
    in_process_engine_env,
    own_nccl_host,
    rank_results,
    start_dp_ranks,
    start_rank,
    wait_for_ranks,
    wait_for_spawned_ffn,
    with_default_ipc_signal,
    worker_command,
    worker_env,
)
from vllm_afd_dev.models.tiny_model import FFN_OUTPUTS, with_zeroed_mlp

VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")
"""The `vllm` command, through its module: no `vllm` script needs to be
installed (the GPU machine imports vLLM from PYTHONPATH)."""
CPU_FFN_ARGS = ("--dtype", "float32", "--enforce-eager")
SERVE_ENGINE = (
    "--dtype", ENGINE_ARGS["dtype"], "--enforce-eager",
    "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
    "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]),
    "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
    "--seed", str(ENGINE_ARGS["seed"]),
    # With data parallel, vLLM kills engines that have not exited when the
    # shutdown timeout (default 0 s) ends; give them time to stop the FFN rank.
    "--shutdown-timeout", "30",
)  # fmt: skip
"""`vllm serve` with the engine settings of the stock reference
(``colocated``): chunked prefill beside decodes, 8 sequences at a time."""


ONE_GPU_FFN_GROUP = (sys.executable, "-m", "vllm_afd_dev.harness.one_gpu_ffn_group")
"""`vllm afd-ffn` with an FFN group's processes sharing one GPU (a test placement)."""


def ffn_server(
    model: Path,
    port: int,
    log: Path,
    timeout_s: float = 180,
    engine: tuple[str, ...] = CPU_FFN_ARGS,
    command: tuple[str, ...] = (*VLLM_CLI, "afd-ffn"),
    env: dict[str, str] | None = None,
    **afd: object,
) -> subprocess.Popen:
    """`vllm afd-ffn` on its own, as a user starts it on the FFN side
    (``command``: or ``ONE_GPU_FFN_GROUP``; ``env`` added to its environment)."""
    config = {"role": "ffn", "port": port, "timeout_s": timeout_s, **afd}
    cmd = [*command, str(model), *engine, "--afd-config", json.dumps(config)]
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**worker_env(), **(env or {})},
        preexec_fn=_sigint_as_from_a_shell,
    )  # fmt: skip


def _sigint_as_from_a_shell() -> None:
    """A test run started as a background job ignores SIGINT, and its
    children would inherit that (Python then installs no KeyboardInterrupt
    handler); a user's shell starts `vllm afd-ffn` with SIGINT at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def running_ffn_rank(
    model: Path, tmp: Path, engine: tuple[str, ...] = CPU_FFN_ARGS, **afd: object
) -> Iterator[tuple[int, Path]]:
    """`vllm afd-ffn` serving ``model`` (``ffn_server``'s arguments) for the
    block. Yields its port and log; once the block has generated against it,
    it must have shut down cleanly."""
    port, log = free_port(), tmp / "ffn.log"
    ffn = ffn_server(model, port, log, engine=engine, **afd)
    try:
        yield port, log
        assert ffn.wait(timeout=60) == 0, failure_report(log.read_text())
    finally:
        ffn.kill()


@contextmanager
def zeroed_ffn_rank(
    model: Path,
    tmp: Path,
    engine: tuple[str, ...] = CPU_FFN_ARGS,
    zeroed: str | tuple[str, ...] = FFN_OUTPUTS,
    **afd: object,
) -> Iterator[int]:
    """The negative controls' FFN side: ``running_ffn_rank`` with layer 1's
    MLP zeroed (its output is zero; or its tensors ending with ``zeroed``).
    Yields its port."""
    broken = with_zeroed_mlp(model, tmp / "zeroed", layer=1, ending=zeroed)
    with running_ffn_rank(broken, tmp, engine, **afd) as (port, _):
        yield port


def assert_every_prompt_changed(broken: list, reference: list) -> None:
    changed = [a != b for a, b in zip(broken, reference, strict=True)]
    assert all(changed), changed


def attention_args(port: int, timeout_s: float = 180, engine: dict | None = None, **afd) -> dict:
    config = with_default_ipc_signal({"port": port, "timeout_s": timeout_s, **afd})
    return {**(engine or {}), "afd_config": config}


def start_attention_rank_of_its_own(
    model: Path,
    port: int,
    rank: int,
    prompts: list[int],
    max_tokens: int,
    stem: Path,
    go_file: Path | None = None,
    **afd: object,
) -> tuple[subprocess.Popen, Path, Path]:
    """Attention rank ``rank`` as a deployment of its own (``attention_rank``,
    data_parallel_size 1) against the FFN rank on ``port``: one generation
    process whose engine core and worker step in it, so that a kill of it
    is the rank's loss; ``PROMPTS[i]`` for i in ``prompts``, its result in
    ``stem``.json and its output in ``stem``.log (``start_rank``; with
    ``go_file``, it generates once that file exists)."""
    engine = attention_args(port, attention_rank=rank, **afd)
    env = {**worker_env(), **in_process_engine_env()}
    return start_rank(model, engine, max_tokens, stem, env, prompts, go_file=go_file)


def wait_for_log(
    proc: subprocess.Popen, log: Path, text: str, report: Callable[[], str], timeout_s=300
) -> None:
    """Until ``log`` holds ``text``; fails with ``report()`` if ``proc`` ends
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None, f"ended before {text!r}:\n{report()}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n{report()}"
        time.sleep(0.2)


def kill_ffn_mid_generation(
    model: Path,
    engine_args: dict,
    ffn: subprocess.Popen,
    out: Path,
    timeout_s: float,
    max_tokens: int = 400,
) -> tuple[int, float, str]:
    """Start a long generation against ``ffn``, kill ``ffn`` once tokens flow,
    and return the attention process's exit code, how long after the kill it
    exited, and its output. Every wait is bounded: a hung attention process
    fails the caller instead of stalling it."""
    attention = subprocess.Popen(
        worker_command(model, engine_args, max_tokens, out),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(),
    )  # fmt: skip
    output: list[str] = []
    generating = threading.Event()

    def pump() -> None:
        for line in attention.stdout:
            output.append(line)
            if line.startswith("generating "):
                generating.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not generating.wait(timeout=1):
            assert attention.poll() is None, failure_report("".join(output))
            assert time.monotonic() < deadline, "generation did not start"
        time.sleep(2)  # mid-generation
        assert attention.poll() is None, "generation ended before the kill"
        ffn.kill()
        killed_at = time.monotonic()
        try:
            code = attention.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"attention side still running {timeout_s} s after the FFN rank was killed:\n"
                + failure_report("".join(output))
            ) from None
        elapsed = time.monotonic() - killed_at
        reader.join(timeout=10)  # the rest of the output, from the engine's children too
        return code, elapsed, "".join(output)
    finally:
        attention.kill()
        ffn.kill()


TOOK_OVER = "an FFN rank took the lost one's place after"
"""What an attention rank logs when a replacement FFN rank has joined it."""
RAN_AGAIN = re.compile(r"step \d+ ran again ([\d.]+) s after the FFN rank was lost")
"""What an attention rank logs once the forward it lost has run again with
a replacement (a redo: gloo, nccl), with the seconds since the loss."""


def generate_killing_ffn_ranks(
    model: Path,
    engine_args: dict,
    kill_ffn_rank: Callable[[], None],
    kills: int,
    env: dict[str, str] | None = None,
    max_tokens: int = 400,
    prompts: list[int] | None = None,
    timeout_s: float = 900,
    after_s: float | tuple[float, ...] = 0.2,
) -> dict:
    """Generate as ``generate.run`` does, calling ``kill_ffn_rank`` ``kills``
    times: ``after_s`` after tokens start to flow, then ``after_s`` after each
    replacement has taken the lost rank's place (failover); a tuple gives
    each kill its own delay (0 kills in the first steps, which prefill the
    prompts in chunks). Returns run's result, with the log. Every wait is
    bounded: a hung deployment fails the caller."""
    delays = after_s if isinstance(after_s, tuple) else (after_s,) * kills
    assert len(delays) == kills, f"{kills} kills, but delays {delays}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.Popen(
            worker_command(model, engine_args, max_tokens, out, prompts),
            env={**worker_env(), **in_process_engine_env(), **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        output: list[str] = []

        def pump() -> None:  # echoed as it comes: a run that hangs shows where
            for line in proc.stdout:
                output.append(line)
                sys.stdout.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        try:
            for kill in range(kills):
                # tokens flow, from the FFN rank that took the last one's place
                while "\ngenerating " not in (log := "".join(output)) or (
                    log.count(TOOK_OVER) < kill
                ):
                    assert proc.poll() is None, failure_report(log)
                    assert time.monotonic() < deadline, failure_report(log)
                    time.sleep(0.05)
                time.sleep(delays[kill])
                assert proc.poll() is None, f"generation ended before kill {kill + 1}"
                kill_ffn_rank()
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            proc.kill()
        reader.join(timeout=10)
        log = "".join(output)
        if code != 0 or not out.is_file():
            raise GenerationError(code, log)
        return {**json.loads(out.read_text()), "log": log}


def kill_attention_rank_mid_generation(
    model: Path,
    engine_args: dict,
    shares: list[list[int]],
    victim: int,
    tmp: Path,
    timeout_s: float,
    max_tokens: int = 400,
    one_gpu: bool = False,
) -> tuple[list[int], float, str]:
    """Offline data parallel (``start_dp_ranks``, ``one_gpu`` as there): once
    every rank generates, kill DP rank ``victim``'s worker (the process that
    holds its AFD connection). Returns every rank's exit code, how long after the kill the
    last one exited, and the logs. Ranks still running ``timeout_s`` after
    the kill are killed, which the caller sees in that time."""
    ranks = start_dp_ranks(model, engine_args, shares, max_tokens, tmp, one_gpu=one_gpu)
    procs, logs = [proc for proc, _, _ in ranks], [log for _, _, log in ranks]

    def text() -> str:
        return "".join(f"== DP rank {r}\n{log.read_text()}" for r, log in enumerate(logs))

    try:
        deadline = time.monotonic() + 600
        while not all("generating " in log.read_text() for log in logs):
            assert all(proc.poll() is None for proc in procs), failure_report(text())
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(1)
        time.sleep(2)  # mid-generation
        assert all(proc.poll() is None for proc in procs), "generation ended before the kill"
        [pid] = set(re.findall(r"\(Worker\S* pid=(\d+)\)", logs[victim].read_text()))
        os.kill(int(pid), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for_ranks(procs, timeout_s)
        elapsed = time.monotonic() - killed_at
        wait_for_spawned_ffn(engine_args)
        return [proc.returncode for proc in procs], elapsed, text()
    finally:
        for proc in procs:
            proc.kill()


def assert_deployment_ended_naming(
    victim: int, codes: list[int], elapsed: float, log: str, port: int, bound_s: float
) -> None:
    """After DP rank ``victim`` of 2A1F was killed: every rank failed, the FFN
    rank named the lost rank, the survivor named it too (or vLLM's own
    data-parallel collectives over gloo, in its engine core or its worker,
    failed first), all within ``bound_s``."""
    survivor = 1 - victim
    said = failure_report(log)
    lost = f"attention rank(s) [{victim}] disconnected without a shutdown message"
    assert all(code != 0 for code in codes), (codes, said)
    assert f"AFD FFN rank 0: {lost}" in log, said
    named = (
        f"AFD attention rank {survivor}: lost the FFN rank at 127.0.0.1:{port} (the FFN rank "
        f"stopped the deployment: {lost}"
    )
    vllm_dp_failed = "coordinate_batch_across_dp" in log or re.search(
        rf"Worker_DP{survivor} pid=\d+\) ERROR .*gloo/transport.*Connection (closed|reset) by peer",
        log,
    )
    assert named in log or vllm_dp_failed, said
    assert elapsed < bound_s, elapsed


def serve_2a1f_to_concurrent_requests(
    model: Path, tmp: Path, engine: tuple[str, ...], requests: int, max_tokens: int, **afd
) -> StepRecord:
    """`vllm serve MODEL --data-parallel-size 2` with a spawned FFN rank for
    both ranks, ``requests`` concurrent completions (so both ranks get work),
    then Ctrl-C. Every answer is complete, and the FFN rank served both
    ranks and shut down with the server. Returns the record the FFN rank
    wrote at shutdown (its ``stats_dir``: ``tmp``; the server's log:
    ``tmp/serve.log``)."""
    port, log = free_port(), tmp / "serve.log"
    config = {"num_attention_ranks": 2, "num_ffn_ranks": 1, "spawn_ffn": True,
              "port": free_port(), "stats_dir": str(tmp), **afd}  # fmt: skip
    server = serve(
        model, port, log, *engine, "--data-parallel-size", "2",
        "--afd-config", json.dumps(config),
        # With data parallel, vLLM kills engines that have not exited when the
        # shutdown timeout (default 0 s) ends; give them time to stop the FFN rank.
        "--shutdown-timeout", "30",
    )  # fmt: skip
    try:
        server = wait_until_healthy(server, port, log)
        prompts = [f"Request {i} asks about rivers, machines and music" for i in range(requests)]
        with ThreadPoolExecutor(requests) as pool:
            answers = list(pool.map(lambda p: complete(port, model, p, max_tokens), prompts))
        assert all(a["usage"]["completion_tokens"] == max_tokens for a in answers)
    finally:
        stop(server)
    try:
        ffn = StepRecord.read(tmp, "FFN rank 0")
    except FileNotFoundError:
        raise AssertionError(failure_report(log.read_text())) from None
    assert ffn.tokens["0"] > 0 and ffn.tokens["1"] > 0, failure_report(log.read_text())
    return ffn


def serve(model: Path, port: int, log: Path, *args: str) -> subprocess.Popen:
    """`vllm serve MODEL ARGS` on 127.0.0.1:port, logging to ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen(
            [*VLLM_CLI, "serve", str(model), *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, env=worker_env(),
        )  # fmt: skip


def kill_engine(server: subprocess.Popen) -> None:
    """SIGKILL the engine of `vllm serve` ``server``: its engine core
    process (vLLM titles it ``VLLM::EngineCore``) and the worker it runs the
    model in, at once, as a crash of the engine's machine would; its API
    server lives on."""
    import psutil

    [core] = [
        p for p in psutil.Process(server.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline())
    ]  # fmt: skip
    for process in (core, *core.children(recursive=True)):
        process.kill()


PORT_TAKEN = "EADDRINUSE"
"""In the log of a `vllm serve` whose engine could not bind the port vLLM
picked for its distributed store: vLLM probes a free port from the kernel's
ephemeral range and binds it in its worker seconds later, and an outgoing
connection of any process on the machine may take it meanwhile (seen in CI
with a data-parallel deployment beside another test's)."""


def wait_until_healthy(
    server: subprocess.Popen, port: int, log: Path, timeout_s=400
) -> subprocess.Popen:
    """Wait until `vllm serve` ``server`` (started by ``serve``) answers on
    /health, and return it. A server whose start failed on ``PORT_TAKEN``
    is started again once with the same command, its log going on in
    ``log``: the race is vLLM's, not the deployment's. The caller holds on
    to the server returned."""
    deadline = time.monotonic() + timeout_s
    started_again = False
    while True:
        if server.poll() is not None:
            text = log.read_text()
            assert PORT_TAKEN in text and not started_again, failure_report(text)
            started_again = True
            with log.open("a") as sink:
                sink.write(f"\n== started again: its engine met {PORT_TAKEN} at start-up\n")
                sink.flush()
                server = subprocess.Popen(server.args, stdout=sink, stderr=subprocess.STDOUT,
                                          env=worker_env())  # fmt: skip
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(2)


def http_get(address: str, path: str) -> tuple[int, str]:
    """GET http://ADDRESS/PATH: the status and the body, errors included."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(port: int, prefix: str) -> dict[tuple[str, tuple], float]:
    """The samples of /metrics whose names start with ``prefix``."""
    status, text = http_get(f"127.0.0.1:{port}", "/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def scrape_until(port: int, prefix: str, settled, timeout_s: float = 10.0) -> dict:
    """``scrape`` until ``settled(samples)``: vLLM's frontend records an
    engine's stats after it has passed on that step's outputs."""
    deadline = time.monotonic() + timeout_s
    while not settled(samples := scrape(port, prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (among others)."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def _greedy_request(port: int, route: str, request: dict, timeout_s: float) -> dict:
    """POST ``request`` to the server's OpenAI ``route``, greedy and without
    stopping at EOS; its JSON answer."""
    body = {**request, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def complete(port: int, model: Path, prompt: str, max_tokens: int = 8) -> dict:
    """One greedy /v1/completions request."""
    request = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens}
    return _greedy_request(port, "/v1/completions", request, timeout_s=120)


def chat_with_an_image(port: int, model: Path, image, text: str, max_tokens: int = 8) -> dict:
    """One greedy /v1/chat/completions request whose user message holds
    ``image`` (a PIL image, sent as a PNG data URL) and then ``text``."""
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    request = {"model": str(model), "messages": [{"role": "user", "content": content}],
               "max_tokens": max_tokens}  # fmt: skip
    return _greedy_request(port, "/v1/chat/completions", request, timeout_s=300)


def stop(server: subprocess.Popen, timeout_s: float = 90) -> int:
    """SIGINT to the server, as `kill -INT` sends it; kill only if it does
    not exit."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.kill()


# Tensors of the FFN role that every process of an FFN rank group holds whole.
_REPLICATED = (".mlp.gate.weight", ".e_score_correction_bias")


def checkpoint_ffn_bytes(model: Path, gate_on_attention: bool) -> tuple[int, int]:
    """Bytes of the FFN role's tensors in ``model``'s safetensors files (not
    those of its multi-token-prediction layers): those an FFN rank group
    splits, and the router gates it holds whole."""
    split = replicated = 0
    config = json.loads((model / "config.json").read_text())
    num_layers = text_config(config)["num_hidden_layers"]
    for name, nbytes in checkpoint_tensor_bytes(model):
        if not is_ffn_weight(name, gate_on_attention, num_layers):
            continue
        if name.endswith(_REPLICATED):
            replicated += nbytes
        else:
            split += nbytes
    return split, replicated


def checkpoint_expert_bytes(model: Path) -> int:
    """Bytes of the routed experts' tensors (``...experts.<id>...``), those
    expert parallelism shares out whole."""
    return sum(n for name, n in checkpoint_tensor_bytes(model) if parse_expert_id(name) is not None)


def run_tp_ranks_on_one_gpu(
    model: Path,
    engine_args: dict,
    tp_size: int = 2,
    max_tokens: int = 24,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
    stock: bool = False,
    workdir: Path | None = None,
) -> dict:
    """A test placement: a tensor-parallel engine whose TP ranks all sit on
    visible GPU 0, one process each, started as vLLM's ``external_launcher``
    backend expects (torchrun's variables; every process runs the whole
    engine and schedules the same batches). NCCL refuses two ranks of one
    host on one GPU, so each rank names a host of its own, as the one-GPU
    data-parallel ranks do; vLLM's custom all-reduce needs a GPU per rank and
    is off. Every rank must generate the same tokens. Returns rank 0's
    result, with every rank's placements and log. Rank r writes its output
    to ``workdir``/rank<r>.log (a temporary folder without one), which a
    caller can watch while they run."""
    args = engine_args | {
        "tensor_parallel_size": tp_size,
        "distributed_executor_backend": "external_launcher",
        "disable_custom_all_reduce": True,
    }
    master_port = free_port()
    with nullcontext(str(workdir)) if workdir else tempfile.TemporaryDirectory() as tmp:
        ranks = []
        for rank in range(tp_size):
            rank_env = {**worker_env(stock), **(env or {}), **own_nccl_host(f"afd-tp-rank-{rank}")}
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE=str(tp_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                VLLM_ENABLE_V1_MULTIPROCESSING="0",
            )
            ranks.append(start_rank(model, args, max_tokens, Path(tmp) / f"rank{rank}", rank_env))
        wait_for_ranks([proc for proc, _, _ in ranks], timeout_s)
        results, logs = rank_results(ranks, "TP rank")
    if any(r["tokens"] != results[0]["tokens"] for r in results):
        raise GenerationError(1, f"the TP ranks generated different tokens\n{logs}")
    return {**results[0], "placements": [p for r in results for p in r["placements"]], "log": logs}


class StreamingCompletions:
    """Greedy streaming completions sent at once to `vllm serve` on
    127.0.0.1:``port``, request i with ``prompts[i]``; each collects its
    token ids as they arrive, and every arrival's time is kept."""

    def __init__(self, port: int, model: Path, prompts: list[str], max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.arrivals: list[float] = []
        """``time.monotonic()`` of each chunk that brought tokens."""
        self.errors: list[str] = []
        self.count = 0
        """Tokens arrived, over all requests."""
        self._arrived = threading.Condition()
        self._threads = [
            threading.Thread(target=self._stream, args=(port, model, prompt, i), daemon=True)
            for i, prompt in enumerate(prompts)
        ]
        for thread in self._threads:
            thread.start()

    def _stream(self, port: int, model: Path, prompt: str, i: int) -> None:
        body = {"model": str(model), "prompt": prompt, "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                for line in reply:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    new = chunk["choices"][0].get("token_ids") or []
                    with self._arrived:
                        self.tokens[i].extend(new)
                        self.count += len(new)
                        self.arrivals.append(time.monotonic())
                        self._arrived.notify_all()
        except Exception as e:  # the caller reports it
            with self._arrived:
                self.errors.append(f"request {i}: {e}")
                self._arrived.notify_all()

    def wait_for(self, count: int, report: Callable[[], str], timeout_s: float = 300) -> None:
        """Until ``count`` tokens have arrived in all (or a request failed);
        ``report`` says why the server failed them (``failure_report``)."""
        with self._arrived:
            flowing = self._arrived.wait_for(
                lambda: self.count >= count or self.errors, timeout=timeout_s
            )
        assert flowing and not self.errors, (self.count, self.errors[:3], report())

    def join(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "requests still running"

    def finished(self) -> set[int]:
        """The requests that have all their tokens."""
        with self._arrived:
            return {i for i, tokens in enumerate(self.tokens) if len(tokens) == self.max_tokens}

    def next_token_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the first token made after it: the end
        of the longest pause between arrivals around it (a token made just
        before it may still be on its way)."""
        with self._arrived:
            times = [t for t in self.arrivals if t >= moment - 1.0]
        gaps = [(b - a, b) for a, b in itertools.pairwise(times) if b > moment]
        assert gaps, "no token arrived after the moment"
        return max(gaps)[1] - moment
