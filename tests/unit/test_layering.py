"""The transfer layer (``vllm/distributed/afd_transfer``) sits below the AFD
runtime and model code (``vllm/afd``) and must not import it, at module level
or inside a function: a connector then builds and runs without any model."""

from __future__ import annotations

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay" / "vllm"


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_transfer_layer_imports_nothing_from_the_runtime_above_it():
    files = sorted((OVERLAY / "distributed" / "afd_transfer").rglob("*.py"))
    assert len(files) > 10
    upward = {
        f"{path.relative_to(OVERLAY)}: {module}"
        for path in files
        for module in imported_modules(path)
        if module == "vllm.afd" or module.startswith("vllm.afd.")
    }
    assert not upward, upward


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vllm.afd.attention.launcher import spawn_local_ffn_ranks\n")
    assert "vllm.afd.attention.launcher" in imported_modules(bad)
