# SPDX-License-Identifier: Apache-2.0
"""What of an upstream model class its ``load_weights`` uses (``upstream_loader``).

The FFN side's layers borrow the loader of a model whose FFN tensors only
that model's own loading loop takes (gpt-oss). A release may give the loader
a new helper (0.33.0 added ``_try_load_streamed_expert``), so the borrowed
methods are read from the class's source: ``load_weights`` and every method
it reaches through calls on itself. The same reading lets a test check each
supported release's source without running it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class LoaderUse:
    methods: frozenset[str]
    """``load_weights`` and the class's methods it reaches (``self.x``,
    ``cls.x``), which the FFN layers borrow."""
    attributes: frozenset[str]
    """Everything else those methods read of the instance or class, which the
    FFN layers must hold (``config``, ``parallel_config``, ``layers``, ...)."""


def loader_use(class_def: ast.ClassDef) -> LoaderUse:
    """What ``load_weights`` of the class ``class_def`` uses of itself."""
    methods = {node.name: node for node in class_def.body if isinstance(node, ast.FunctionDef)}
    if "load_weights" not in methods:
        raise ValueError(f"{class_def.name} defines no load_weights to borrow")
    reached: set[str] = set()
    attributes: set[str] = set()
    pending = ["load_weights"]
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        for node in ast.walk(methods[name]):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                if node.attr in methods:
                    pending.append(node.attr)
                else:
                    attributes.add(node.attr)
    return LoaderUse(frozenset(reached), frozenset(attributes))


def class_loader_use(upstream: type) -> LoaderUse:
    """``loader_use`` of a live class, read from its source."""
    [class_def] = ast.parse(textwrap.dedent(inspect.getsource(upstream))).body
    assert isinstance(class_def, ast.ClassDef)
    return loader_use(class_def)
