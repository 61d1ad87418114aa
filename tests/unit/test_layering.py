"""The layers of the overlay, lowest first, and what each may import.

- The transfer layer (``vllm/distributed/afd_transfer``) sits below the AFD
  runtime and model code (``vllm/afd``) and must not import it: a connector
  then builds and runs without any model.
- The config layer (``vllm/config``) describes a deployment; of the runtime
  it imports only its verification entry point (``vllm.afd.verify``).
- Within the runtime no modules import each other in a circle.

An import inside a function counts as much as one at the top of a module:
it is the same dependency, only later."""

from __future__ import annotations

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay" / "vllm"
RUNTIME = "vllm.afd"
VERIFY = "vllm.afd.verify"


def imported_modules(path: Path, with_names: bool = False) -> set[str]:
    """The modules ``path`` imports; ``with_names``: also ``module.name`` for
    each name of a ``from module import name`` (which may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if with_names:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def runtime_imports(files: list[Path], root: Path, allowed: frozenset[str] = frozenset()):
    """``path: module`` for each import of the runtime in ``files`` other than ``allowed``."""
    return {
        f"{path.relative_to(root)}: {module}"
        for path in files
        for module in imported_modules(path)
        if (module == RUNTIME or module.startswith(RUNTIME + ".")) and module not in allowed
    }


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path, root: Path) -> dict[str, set[str]]:
    """Each module of ``package`` (under ``root``, the folder that holds the
    top package) and the modules of ``package`` it imports, a submodule
    taken by ``from package import submodule`` included."""
    modules = {module_name(p, root): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = imported_modules(path, with_names=True)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly
    connected components of more than one module)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_the_transfer_layer_imports_nothing_from_the_runtime_above_it():
    files = sorted((OVERLAY / "distributed" / "afd_transfer").rglob("*.py"))
    assert len(files) > 10
    upward = runtime_imports(files, OVERLAY)
    assert not upward, upward


def test_the_config_layer_imports_only_the_runtimes_verification():
    files = sorted((OVERLAY / "config").rglob("*.py"))
    assert files
    upward = runtime_imports(files, OVERLAY, allowed=frozenset({VERIFY}))
    assert not upward, upward
    # ... and does import it: the checks run from there.
    assert VERIFY in imported_modules(OVERLAY / "config" / "afd.py")


def test_the_runtime_imports_no_module_in_a_circle():
    graph = import_graph(OVERLAY / "afd", OVERLAY.parent)
    assert len(graph) > 20 and "vllm.afd.models.ffn_model" in graph
    assert not import_circles(graph)


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vllm.afd.attention.launcher import spawn_local_ffn_ranks\n")
    assert "vllm.afd.attention.launcher" in imported_modules(bad)
    assert runtime_imports([bad], tmp_path) == {"bad.py: vllm.afd.attention.launcher"}


def test_the_config_check_allows_only_the_verification(tmp_path):
    config = tmp_path / "afd.py"
    config.write_text(
        "def verify():\n    from vllm.afd.verify import verify_afd_config\n"
        "def set_up():\n    from vllm.afd.platform.mps import ensure_private_daemon\n"
    )
    allowed = frozenset({VERIFY})
    assert runtime_imports([config], tmp_path, allowed) == {"afd.py: vllm.afd.platform.mps"}


def test_the_circle_check_sees_a_circle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")  # imports into the circle, not in it
    graph = import_graph(package, tmp_path)
    assert graph["pkg.d"] == {"pkg", "pkg.a"}
    assert import_circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
