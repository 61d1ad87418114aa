#!/usr/bin/env python3
"""Lay the AFD patch series and overlay over a vLLM tree: fetch, apply, check,
reverse, status, refresh, build-wheel, rebase-check, releases, hash.

    python scripts/apply_patches.py --help

The tool is ``vllm_afd_dev.patchtool`` (docs/patch-series.md). It needs only
patch-ng and packaging: where the package is not installed (a plain
``python3``, before ``scripts/setup_env.sh``), this runs it as
``python -m vllm_afd_dev.patchtool`` from this checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    from vllm_afd_dev.patchtool.cli import main
except ModuleNotFoundError as e:
    if e.name != "vllm_afd_dev":
        raise
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "vllm_afd_dev.patchtool", *sys.argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, "PYTHONPATH": path})

if __name__ == "__main__":
    raise SystemExit(main())
