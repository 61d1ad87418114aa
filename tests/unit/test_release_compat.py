"""What AFD asks of vLLM where releases differ: which model runner runs
(vLLM 0.34 removed Model Runner V1), how a CPU-only FFN process silences
torch's accelerator calls, and where the GPU tests and benchmarks ask for V1.

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

from vllm_afd_dev.harness import gpu_settings
from vllm_afd_dev.harness import model_runner as harness_runner
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


def test_which_model_runner_runs(monkeypatch):
    """Told from vLLM's config class, so that configs made by hand (the
    tests' namespaces) count as the release's too."""
    import vllm.config

    assert has_model_runner_v1()  # the release installed here still has V1
    for v2 in (False, True):
        config = ConfigWithV1(v2)
        assert runs_model_runner_v2(config) is v2 and config.asked == 1
    monkeypatch.setattr(vllm.config, "VllmConfig", ConfigWithoutV1)
    assert not has_model_runner_v1()
    assert runs_model_runner_v2(ConfigWithoutV1())


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


def fake_vllm(root: Path, v1: bool) -> Path:
    package = root / "vllm"
    (package / "v1" / "worker").mkdir(parents=True)
    if v1:
        (package / "v1" / "worker" / "gpu_model_runner.py").write_text("")
    return package


def test_the_harness_asks_for_v1_only_where_vllm_has_it(tmp_path):
    with_v1 = fake_vllm(tmp_path / "old", v1=True)
    without = fake_vllm(tmp_path / "new", v1=False)
    assert harness_runner.model_runner_v1_env("x", with_v1) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert harness_runner.prefer_model_runner_v1(with_v1) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    with pytest.raises(harness_runner.NoModelRunnerV1, match="the row 'x' runs on Model Runner"):
        harness_runner.model_runner_v1_env("the row 'x'", without)
    assert harness_runner.prefer_model_runner_v1(without) == {}
    assert harness_runner.has_model_runner_v1()  # the vLLM installed here


def test_a_v1_setting_skips_its_gpu_test_where_vllm_has_no_v1(tmp_path, monkeypatch):
    assert gpu_settings.runner_env("FULL_DECODE_ONLY-V1") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    without = fake_vllm(tmp_path, v1=False)
    monkeypatch.setattr(harness_runner, "installed_vllm", lambda: without)
    assert gpu_settings.runner_env("FULL_DECODE_ONLY") == {}
    with pytest.raises(pytest.skip.Exception, match="FULL_DECODE_ONLY-V1 setting runs on Model"):
        gpu_settings.runner_env("FULL_DECODE_ONLY-V1")


def test_a_v2_setting_selects_v2_on_every_release(tmp_path, monkeypatch):
    """``VLLM_USE_V2_MODEL_RUNNER=1`` is valid with and without V1 (0.34 takes
    only 1); a runner setting runs its plain setting's engine."""
    for v1 in (True, False):
        vllm = fake_vllm(tmp_path / str(v1), v1=v1)
        monkeypatch.setattr(harness_runner, "installed_vllm", lambda vllm=vllm: vllm)
        assert gpu_settings.runner_env("FULL_DECODE_ONLY-V2") == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    for runner in ("V1", "V2"):
        assert gpu_settings.engine(f"FULL_DECODE_ONLY-{runner}") == gpu_settings.engine(
            "FULL_DECODE_ONLY"
        )
        assert gpu_settings.engine(f"eager-{runner}") == gpu_settings.engine("eager")
        assert gpu_settings.ffn_cli_args(f"FULL_DECODE_ONLY-{runner}") == (
            gpu_settings.ffn_cli_args("FULL_DECODE_ONLY")
        )


def test_the_harness_asks_for_v2_micro_batching_only_where_vllm_has_it(tmp_path, monkeypatch):
    """The GPU micro-batch tests' V2 settings: V2 asked for by name (vLLM
    picks V1 for micro-batching otherwise), skipped where V2 cannot split a
    step (vLLM 0.26)."""
    old = fake_vllm(tmp_path / "old", v1=True)
    new = fake_vllm(tmp_path / "new", v1=True)
    (new / "v1" / "worker" / "gpu").mkdir()
    (new / "v1" / "worker" / "gpu" / "ubatch_utils.py").write_text("")
    assert harness_runner.has_model_runner_v2_micro_batching(new)
    assert not harness_runner.has_model_runner_v2_micro_batching(old)
    env = harness_runner.model_runner_v2_micro_batching_env("x", new)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    with pytest.raises(harness_runner.NoModelRunnerV2MicroBatching, match="x runs on Model"):
        harness_runner.model_runner_v2_micro_batching_env("x", old)
    monkeypatch.setattr(harness_runner, "installed_vllm", lambda: new)
    assert gpu_settings.micro_batching_env("FULL_DECODE_ONLY-V2") == env
    assert gpu_settings.micro_batching_env("FULL_DECODE_ONLY-V1") == {
        "VLLM_USE_V2_MODEL_RUNNER": "0"
    }
    monkeypatch.setattr(harness_runner, "installed_vllm", lambda: old)
    with pytest.raises(pytest.skip.Exception, match="FULL_DECODE_ONLY-V2 setting runs on Model"):
        gpu_settings.micro_batching_env("FULL_DECODE_ONLY-V2")


@pytest.mark.parametrize("release", RELEASES)
def test_model_runner_v2_micro_batches_from_the_release_the_patch_tool_names(release, series):
    """The premise of 0028's ``Requires: model-runner-v2-micro-batching`` and
    of ``model_runner_v2_micro_batches``: V2's ubatch_utils module, with the
    runner and the joint decision 0028 reaches, exists exactly from the
    release the tool knows as the one that added it."""
    from vllm_afd_dev.patchtool.series import ADDED

    tree = release_tree(series, release) / "vllm" / "v1" / "worker" / "gpu"
    added_in = ADDED["model-runner-v2-micro-batching"][1]
    has = (tree / "ubatch_utils.py").is_file()
    assert has is (release_key(release) >= release_key(added_in))
    if has:
        assert defines(tree / "ubatch_utils.py", "maybe_build_ubatch_runner")
        assert defines(tree / "dp_utils.py", "sync_cudagraph_and_dp_padding")
        assert defines(tree / "cudagraph_utils.py", "_maybe_ubatch_twin")


def test_no_tool_sets_the_v1_runner_but_through_the_harness():
    """VLLM_USE_V2_MODEL_RUNNER=0 is an error on vLLM 0.34: the GPU tests and
    the benchmarks ask for it only through ``model_runner_v1_env``."""
    root = Path(__file__).resolve().parents[2]
    setting = '"VLLM_USE_V2_MODEL_RUNNER": "0"'
    found = [
        str(path.relative_to(root))
        for folder in ("benchmarks", "vllm_afd_dev", "scripts", "tests/gpu", "tests/e2e")
        for path in sorted((root / folder).rglob("*.py"))
        if setting in path.read_text()
    ]
    assert found == ["vllm_afd_dev/harness/model_runner.py"]
