"""What AFD asks of vLLM where releases differ: which model runner runs
(vLLM 0.34 removed Model Runner V1) and how a CPU-only FFN process silences
torch's accelerator calls.

Newer releases have no CPU wheel to run here, so each supported release's
source is read for the facts these helpers rely on.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from vllm.afd.ffn import worker as ffn_worker
from vllm.afd.runners import (
    cpu_runner_without_afd_hooks,
    has_model_runner_v1,
    runs_model_runner_v2,
)
from vllm.config import VllmConfig

from vllm_afd_dev.patchtool.fetch import pinned_pristine, pristine_from_wheel
from vllm_afd_dev.patchtool.series import Series, release_key

RELEASES = Series.load().releases


def release_tree(series: Series, release: str) -> Path:
    """The release's pristine tree, as `apply_patches.py check` reads it (cached)."""
    if release == series.pin.version:
        return pinned_pristine(series.pin, series.wheel(release), log=print)
    return pristine_from_wheel(series.wheel(release), release, python_only=True, log=print)


def defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` (a function, class or property) anywhere."""
    if not path.is_file():
        return False
    return any(
        isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name
        for node in ast.walk(ast.parse(path.read_text()))
    )


class ConfigWithoutV1:
    """A config class as vLLM 0.34's: no ``use_v2_model_runner``."""


class ConfigWithV1:
    """A config class as vLLM 0.33's: the property decides."""

    def __init__(self, v2: bool):
        self.v2 = v2
        self.asked = 0

    @property
    def use_v2_model_runner(self) -> bool:
        self.asked += 1
        return self.v2


def test_which_model_runner_runs():
    assert has_model_runner_v1(VllmConfig)  # the release installed here still has V1
    assert not has_model_runner_v1(ConfigWithoutV1())
    assert runs_model_runner_v2(ConfigWithoutV1())
    for v2 in (False, True):
        config = ConfigWithV1(v2)
        assert has_model_runner_v1(config) and config.asked == 0  # not weighed to tell
        assert runs_model_runner_v2(config) is v2 and config.asked == 1


@pytest.mark.parametrize("release", RELEASES)
def test_vllm_config_decides_the_runner_exactly_where_v1_exists(release, series):
    """The premise of ``has_model_runner_v1``: a release's VllmConfig has
    ``use_v2_model_runner`` if and only if it ships Model Runner V1; and it
    runs StandaloneCPUModelRunner only where it has no V1."""
    tree = release_tree(series, release) / "vllm"
    v1 = (tree / "v1" / "worker" / "gpu_model_runner.py").is_file()
    assert defines(tree / "config" / "vllm.py", "use_v2_model_runner") is v1
    assert v1 is (release_key(release) < release_key("0.34.0"))
    standalone = defines(tree / "platforms" / "interface.py", "uses_standalone_cpu_model_runner")
    assert not (standalone and v1)
    if standalone:
        worker = (tree / "v1" / "worker" / "cpu_worker.py").read_text()
        assert "current_platform.uses_standalone_cpu_model_runner()" in worker
        assert "StandaloneCPUModelRunner(" in worker


def test_the_cpu_runner_without_afd_hooks_is_named(monkeypatch):
    from vllm.platforms import current_platform

    assert cpu_runner_without_afd_hooks() is None  # 0.26 has no such runner
    monkeypatch.setattr(type(current_platform), "uses_standalone_cpu_model_runner",
                        classmethod(lambda cls: False), raising=False)  # fmt: skip
    assert cpu_runner_without_afd_hooks() is None
    monkeypatch.setattr(type(current_platform), "uses_standalone_cpu_model_runner",
                        classmethod(lambda cls: True), raising=False)  # fmt: skip
    assert cpu_runner_without_afd_hooks() == "StandaloneCPUModelRunner"


@pytest.fixture
def restored_accelerator(monkeypatch):
    """torch.accelerator's calls as they are now, put back after the test."""
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.accelerator, name, getattr(torch.accelerator, name))


def test_cpu_accelerator_noop_where_vllm_has_its_v1_helper(restored_accelerator):
    assert ffn_worker.set_cpu_accelerator_to_noop() == ffn_worker.CPU_ACCELERATOR_NOOP
    assert torch.accelerator.empty_cache() is None  # a no-op, on a CPU-only torch too
    assert torch.accelerator.synchronize() is None


def test_cpu_accelerator_noop_where_vllm_has_only_its_cpu_shim(restored_accelerator, monkeypatch):
    """vLLM 0.34 removed cpu_model_runner.py: importing the CPU worker's shim,
    which patches torch as it is imported, takes its place."""
    imported = []
    shim = ModuleType(ffn_worker.CPU_TORCH_SHIM)
    monkeypatch.setitem(sys.modules, ffn_worker.CPU_TORCH_SHIM, shim)
    real_find_spec = ffn_worker.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == ffn_worker.CPU_ACCELERATOR_NOOP else real_find_spec(name, *args)

    def import_module(name):
        imported.append(name)
        return sys.modules[name]

    monkeypatch.setattr(ffn_worker.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(ffn_worker.importlib, "import_module", import_module)
    assert ffn_worker.set_cpu_accelerator_to_noop() == ffn_worker.CPU_TORCH_SHIM
    assert imported == [ffn_worker.CPU_TORCH_SHIM]


def module_assigns(path: Path, target: str) -> bool:
    """Whether module ``path`` assigns ``target`` (e.g. torch.accelerator.empty_cache)
    in its top-level statements, so that importing it does."""
    return any(
        isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets)
        for node in ast.parse(path.read_text()).body
    )


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_has_the_cpu_accelerator_noop_the_ffn_worker_takes(release, series):
    tree = release_tree(series, release)
    legacy = tree / (ffn_worker.CPU_ACCELERATOR_NOOP.replace(".", "/") + ".py")
    if legacy.is_file():
        assert defines(legacy, "_set_torch_accelerator_to_noop")
        return
    assert release_key(release) >= release_key("0.34.0")
    shim = tree / (ffn_worker.CPU_TORCH_SHIM.replace(".", "/") + ".py")
    for call in ("synchronize", "empty_cache"):
        assert module_assigns(shim, f"torch.accelerator.{call}"), (release, call)
