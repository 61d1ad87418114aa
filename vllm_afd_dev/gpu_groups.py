"""Run groups of GPU tests side by side, each in its own pytest process.

    python3 scripts/gpu_test_groups.py --logs $OUT --suite all --list   # the plan
    python3 scripts/gpu_test_groups.py --logs $OUT --suite all --part 1
    python3 scripts/gpu_test_groups.py --logs $OUT --only 1a1f controls patched
    python3 scripts/gpu_test_groups.py --logs $OUT --timeout 540 \\
        --group v1 0 tests/gpu/test_afd_gpu.py "V1 and ipc" \\
        --group nccl 0,1 tests/gpu/test_afd_gpu.py "1a1f and nccl" \\
        --mps-group v1-mps 0 tests/gpu/test_afd_gpu.py "V1 and ipc"

One engine run takes about a minute on the GPU machine, mostly start-up on
the CPU, and device time there is scarce; the tests' engines fix their KV
cache size (``kv_cache_memory_bytes``), so several can share a GPU without
disturbing each other's memory profiling, and ask for the share of the GPU
that the plan of the groups sharing it gives them
(``vllm_afd_dev.bench.gpu_memory.gpu_test_plan``: each group is told how
many share its GPU in ``AFD_GPU_TEST_GROUPS``); a call whose groups do not
fit is refused before any starts, saying how many would. Each group gets
the GPUs named (``CUDA_VISIBLE_DEVICES``) and writes ``<logs>/<name>.log``.
Prints each group's outcome as it ends; exits non-zero if any group failed
or ran out of time.

``--suite all`` takes the groups of ``tests/gpu/groups.toml`` (name, test
files, -k expression, time budget, MPS or not, GPUs needed) that fit the
machine's ``--gpus`` (1 by default: groups that need two or more are left
out). At most ``--jobs`` groups run side by side (start-up load: more
engines starting at once on the machine's cores made their FFN ranks miss
their timeouts); a suite with more is cut into parts of similar budgets,
one call each (``--part``; without it every part runs, one after another).
``--list`` prints the plan (groups, budgets, their sum, the parts) and
runs nothing. ``--only NAME ...`` runs the groups of the file so named,
side by side in one call.

``--mps-group`` (and a group with ``mps = true``) runs a group under NVIDIA
MPS: the first one starts a private MPS control daemon
(``vllm.afd.platform.mps``, as ``"mps": "start"`` does) whose clients these
groups' processes are; ``--group`` runs without MPS (unless a daemon in the
default pipe directory serves the whole machine). The daemon stops when
this script ends.

``--group-env NAME VAR=VALUE`` adds to one group's environment: groups of
another release's trees run beside 0.26.0's under the same daemon with
``--group-env NAME PYTHONPATH=/tmp/site33 --group-env NAME
AFD_STOCK_VLLM=/tmp/pristine33``; pytest options reach a group through
``PYTEST_ADDOPTS`` (``--group-env NAME PYTEST_ADDOPTS=--ipc-signal=stream``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_afd_dev import MODELS, ROOT
from vllm_afd_dev.bench.gpu_memory import TEST_GROUPS_ENV

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

GROUPS_FILE = ROOT / "tests" / "gpu" / "groups.toml"
SUITES = ("all",)
DEFAULT_JOBS = 8
"""Groups side by side: up to nine ran well on one H200 with 16 cores
(docs/gpu-runs.md)."""


@dataclass(frozen=True)
class Group:
    """One pytest process: ``files`` with ``-k k`` on GPUs 0..gpus-1."""

    name: str
    files: tuple[str, ...]
    k: str = ""
    budget_s: float = 0.0
    mps: bool = False
    gpus: int = 1
    pytest_args: tuple[str, ...] = ()
    visible: str = field(default="", compare=False)
    """``CUDA_VISIBLE_DEVICES``; by default ``0,...,gpus-1``."""

    @property
    def devices(self) -> str:
        return self.visible or ",".join(str(i) for i in range(self.gpus))

    def command(self) -> list[str]:
        k = ["-k", self.k] if self.k else []
        return [sys.executable, "-m", "pytest", "-m", "gpu", *self.files, *k, "-v", "-s",
                "-p", "no:cacheprovider", *self.pytest_args]  # fmt: skip


KEYS = {"name", "files", "k", "budget_s", "mps", "gpus", "pytest_args"}


def load_groups(path: Path = GROUPS_FILE) -> list[Group]:
    """The groups of ``path`` (``tests/gpu/groups.toml``), checked."""
    groups = []
    for i, entry in enumerate(tomllib.loads(path.read_text()).get("group", [])):
        where = f"{path}: group {i + 1} ({entry.get('name', 'no name')})"
        unknown = set(entry) - KEYS
        missing = {"name", "files", "budget_s", "mps"} - set(entry)
        if unknown or missing:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}, missing {sorted(missing)}")
        if not entry["files"] or entry["budget_s"] <= 0 or entry.get("gpus", 1) < 1:
            raise ValueError(f"{where}: needs files, a budget above 0 and gpus of 1 or more")
        groups.append(
            Group(
                name=entry["name"],
                files=tuple(entry["files"]),
                k=entry.get("k", ""),
                budget_s=float(entry["budget_s"]),
                mps=bool(entry["mps"]),
                gpus=int(entry.get("gpus", 1)),
                pytest_args=tuple(entry.get("pytest_args", ())),
            )
        )
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(
            f"{path}: group names repeat: {sorted(n for n in names if names.count(n) > 1)}"
        )
    return groups


def suite(name: str, groups: list[Group], gpus: int) -> list[Group]:
    """The groups of suite ``name`` on a machine with ``gpus`` GPUs: ``all``
    is every group that needs no more."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r} (one of {', '.join(SUITES)})")
    return [g for g in groups if g.gpus <= gpus]


def parts(groups: list[Group], jobs: int) -> list[list[Group]]:
    """``groups`` cut into calls of at most ``jobs`` groups side by side,
    longest budgets together: a call lasts about its longest group, so this
    keeps the sum of the calls' longest budgets low."""
    ordered = sorted(groups, key=lambda g: -g.budget_s)
    count = -(-len(ordered) // jobs) if ordered else 0
    size = -(-len(ordered) // count) if count else 0
    return [ordered[i : i + size] for i in range(0, len(ordered), size)] if size else []


def describe_plan(name: str, chosen: list[Group], left_out: list[Group], cut: list[list[Group]],
                  jobs: int, timeout_s: float) -> str:  # fmt: skip
    """The plan as ``--list`` prints it (and every suite call before it runs)."""
    total = sum(g.budget_s for g in chosen)
    longest = sum(max(g.budget_s for g in part) for part in cut)
    lines = [
        f"suite {name}: {len(chosen)} groups, budgets {total:.0f} s in all "
        f"({total / 60:.0f} min one after another); at most {jobs} side by side: "
        f"{len(cut)} call(s) of about {', '.join(f'{max(g.budget_s for g in p):.0f}' for p in cut)}"
        f" s ({longest:.0f} s in all)"
    ]
    for i, part in enumerate(cut, 1):
        over = max(g.budget_s for g in part) > timeout_s
        lines.append(
            f"part {i}:" + (f" (a budget exceeds --timeout {timeout_s:.0f} s)" if over else "")
        )
        for g in part:
            under = "MPS" if g.mps else "no MPS"
            lines.append(f"  {g.name:34s} {g.budget_s:5.0f} s  GPU {g.devices:7s} {under:6s}  "
                         f"{' '.join(g.files)} -k {g.k!r}")  # fmt: skip
    if left_out:
        lines.append("left out (more GPUs than --gpus): " + ", ".join(g.name for g in left_out))
    return "\n".join(lines)


def groups_sharing(group: Group, call: list[Group]) -> int:
    """How many groups of ``call`` share the busiest of ``group``'s GPUs."""
    return max(sum(d in g.devices.split(",") for g in call) for d in group.devices.split(","))


def check_gpu_memory(call: list[Group]) -> None:
    """Refuse, before any group starts, a call whose groups cannot share a
    GPU: the test engines' memory settings come from the plan of the groups
    sharing their GPU (``vllm_afd_dev.bench.gpu_memory.gpu_test_plan``,
    ``AFD_GPU_TEST_GROUPS``). Nothing to check without CUDA."""
    import torch

    from vllm_afd_dev.bench.gpu_memory import (
        GpuMemoryError,
        gpu_test_plan,
        gpu_total_bytes,
        largest_checkpoint_bytes,
        most_test_groups,
    )

    if not call or not torch.cuda.is_available():
        return
    sharing = max(groups_sharing(g, call) for g in call)
    total, weights = gpu_total_bytes(), largest_checkpoint_bytes(MODELS)
    try:
        gpu_test_plan(total, sharing, weights)
    except GpuMemoryError as e:
        raise SystemExit(f"{e}\nAt most {most_test_groups(total, weights)} groups fit side by "
                         "side on one of these GPUs.") from None  # fmt: skip


def group_environments(mps: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of a group without MPS, and what a group under MPS
    adds to it: with ``mps``, the pipe directory of a private MPS daemon
    started now, which stops when this process ends."""
    no_mps = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
    if not mps:
        return no_mps, {}
    from vllm.afd.platform.mps import ensure_private_daemon

    os.environ.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    return no_mps, {"CUDA_MPS_PIPE_DIRECTORY": ensure_private_daemon()}


def run_groups(
    groups: list[Group],
    logs: Path,
    timeout_s: float,
    envs: tuple[dict[str, str], dict[str, str]],
    extra_env: dict[str, dict[str, str]],
) -> list[str]:
    """Run ``groups`` side by side, each in its own session, in ``envs``
    (``group_environments``), until they end or ``timeout_s`` has passed
    (then they are killed with what they started). Prints each outcome as
    it comes; returns the names of the groups that failed or ran out of
    time."""
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    no_mps, mps = envs
    running = {}
    for g in groups:
        env = {**no_mps, **(mps if g.mps else {}), **extra_env.get(g.name, {}),
               "CUDA_VISIBLE_DEVICES": g.devices,
               TEST_GROUPS_ENV: str(groups_sharing(g, groups))}  # fmt: skip
        log = (logs / f"{g.name}.log").open("w")
        running[g.name] = subprocess.Popen(
            g.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        under = " under MPS" if g.mps else ""
        print(f"started {g.name} on GPU {g.devices}{under}: -k {g.k!r}", flush=True)
    failed = []
    while running:
        time.sleep(2)
        out_of_time = time.monotonic() - start > timeout_s
        for name, proc in list(running.items()):
            if proc.poll() is None and not out_of_time:
                continue
            if proc.poll() is None:  # with the engines it started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                outcome = "killed: out of time"
            else:
                lines = (logs / f"{name}.log").read_text().strip().splitlines()
                outcome = lines[-1] if lines else f"exit {proc.returncode}"
            if proc.returncode != 0:
                failed.append(name)
            print(f"[{time.monotonic() - start:5.0f} s] {name}: {outcome}", flush=True)
            del running[name]
    return failed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="The groups of --suite: tests/gpu/groups.toml (docs/gpu.md).",
    )
    for flag, what in (
        ("--group", "a pytest process: log name, CUDA_VISIBLE_DEVICES, test file, -k expression"),
        ("--mps-group", "the same, under a private MPS daemon"),
    ):
        parser.add_argument(
            flag, nargs=4, action="append", default=[], metavar=("NAME", "GPUS", "FILE", "KEXPR"),
            help=what,
        )  # fmt: skip
    parser.add_argument(
        "--group-env", nargs=2, action="append", default=[], metavar=("NAME", "VAR=VALUE"),
        help="one more environment variable for the group NAME",
    )  # fmt: skip
    parser.add_argument("--suite", choices=SUITES, help="the groups of the groups file")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME",
                        help="these groups of the groups file, side by side, one call")  # fmt: skip
    parser.add_argument("--groups-file", type=Path, default=GROUPS_FILE)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the machine (--suite)")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS,
                        help="groups side by side at most (--suite)")  # fmt: skip
    parser.add_argument("--part", type=int, help="run only this part of the suite (1, 2, ...)")
    parser.add_argument("--list", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--logs", type=Path, help="where the groups' logs go (required to run)")
    parser.add_argument(
        "--timeout", type=float, default=540, help="seconds for all groups of one call (part)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ad_hoc = [Group(name, (file,), kexpr, gpus=len(gpus.split(",")), visible=gpus)
              for name, gpus, file, kexpr in args.group] + [
             Group(name, (file,), kexpr, mps=True, gpus=len(gpus.split(",")), visible=gpus)
             for name, gpus, file, kexpr in args.mps_group]  # fmt: skip
    cut: list[list[Group]] = []
    if args.suite:
        every = load_groups(args.groups_file)
        chosen = suite(args.suite, every, args.gpus)
        cut = parts(chosen, args.jobs)
        left_out = [g for g in every if g not in chosen]
        print(describe_plan(args.suite, chosen, left_out, cut, args.jobs, args.timeout), flush=True)
        if args.part is not None:
            if not 1 <= args.part <= len(cut):
                parser.error(f"--part {args.part}: the suite has parts 1 to {len(cut)}")
            cut = [cut[args.part - 1]]
    elif args.part is not None:
        parser.error("--part needs --suite")
    if args.only:
        if args.suite:
            parser.error("--only and --suite: give one of them")
        by_name = {g.name: g for g in load_groups(args.groups_file)}
        unknown = [n for n in args.only if n not in by_name]
        if unknown:
            parser.error(f"--only: no groups {unknown} in {args.groups_file} "
                         f"(--suite all --list prints them)")  # fmt: skip
        cut = [[by_name[n] for n in dict.fromkeys(args.only)]]
        print(describe_plan("of --only", cut[0], [], cut, len(cut[0]), args.timeout), flush=True)
    calls = [part + ad_hoc for part in cut] if cut else [ad_hoc]
    names = [g.name for call in calls for g in call]
    if len(set(names)) != len(names):
        parser.error(f"group names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    extra_env: dict[str, dict[str, str]] = {}
    for name, assignment in args.group_env:
        var, sep, value = assignment.partition("=")
        if name not in names or not sep or not var:
            parser.error(
                f"--group-env {name} {assignment}: name a group given with --group, "
                f"--mps-group or --suite ({', '.join(sorted(names))}) and write VAR=VALUE"
            )
        extra_env.setdefault(name, {})[var] = value
    if args.list:
        return 0
    if not args.logs:
        parser.error("--logs is required to run groups")
    if not any(calls):
        parser.error("no groups: give --suite, --group or --mps-group")
    for call in calls:
        check_gpu_memory(call)
    envs = group_environments(any(g.mps for call in calls for g in call))
    failed = []
    for i, call in enumerate(calls, 1):
        if len(calls) > 1:
            print(f"== part {i} of {len(calls)}", flush=True)
        failed += run_groups(call, args.logs, args.timeout, envs, extra_env)
    return 1 if failed else 0
