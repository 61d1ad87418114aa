"""The FFN side's layers load through an upstream model's own loader
(``upstream_loader``, gpt-oss) in every supported release.

Newer releases have no CPU wheel to run them here, so each release's source
of that model class is read: the methods its ``load_weights`` reaches are
the ones the FFN layers borrow, and whatever else those read of themselves
the FFN layers must hold. 0.33.0's loader calls a helper that 0.26.0's has
not (``_try_load_streamed_expert``); borrowing only the ``load_weights*``
methods, as the FFN layers once did, left it out and failed gpt-oss there.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.afd.models.ffn_model import _FFNLayers, _layers_class
from vllm.afd.models.registry import SUPPORTED_ARCHITECTURES
from vllm.afd.models.upstream_loader import class_loader_use, loader_use

from vllm_afd_dev.patchtool.fetch import pinned_pristine, pristine_from_wheel
from vllm_afd_dev.patchtool.series import Series

BORROWING = {arch: spec.upstream_loader() for arch, spec in SUPPORTED_ARCHITECTURES.items()
             if spec.upstream_loader is not None}  # fmt: skip


def held_by_ffn_layers() -> set[str]:
    """The attributes an FFN layers object holds of its own."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=None), parallel_config=None, quant_config=None
    )
    return set(dir(_FFNLayers([], config)))


def release_tree(series: Series, release: str) -> Path:
    """The release's pristine tree, as `apply_patches.py check` reads it (cached)."""
    if release == series.pin.version:
        return pinned_pristine(series.pin, series.wheel(release), log=print)
    return pristine_from_wheel(series.wheel(release), release, python_only=True, log=print)


def class_source(tree: Path, upstream: type) -> ast.ClassDef:
    path = tree / (upstream.__module__.replace(".", "/") + ".py")
    classes = [node for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.ClassDef) and node.name == upstream.__name__]  # fmt: skip
    assert classes, f"{path} defines no {upstream.__name__}"
    return classes[0]


def test_an_architecture_borrows_an_upstream_loader():
    assert BORROWING  # gpt-oss: else this file checks nothing


@pytest.mark.parametrize("release", Series.load().releases)
@pytest.mark.parametrize("arch", sorted(BORROWING))
def test_the_ffn_layers_hold_what_each_releases_loader_reads(arch, release, series):
    tree = release_tree(series, release)
    use = loader_use(class_source(tree, BORROWING[arch]))
    missing = use.attributes - held_by_ffn_layers()
    assert not missing, (
        f"vLLM {release}'s {BORROWING[arch].__name__}.load_weights reads {sorted(missing)} of "
        "itself, which the FFN layers neither borrow nor hold"
    )


@pytest.mark.parametrize("arch", sorted(BORROWING))
def test_the_ffn_layers_borrow_the_installed_loader_and_its_helpers(arch):
    upstream = BORROWING[arch]
    layers = _layers_class(upstream)
    use = class_loader_use(upstream)
    assert "load_weights" in use.methods
    for name in use.methods:
        assert vars(layers)[name] is vars(upstream)[name], name
    assert layers.forward is not upstream.forward  # the forward pass stays upstream's
