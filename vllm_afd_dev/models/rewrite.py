"""Rewrite a safetensors checkpoint tensor by tensor into another stored form
(``fp8_checkpoint``: DeepSeek-V3's FP8 blocks; ``mxfp4_checkpoint``:
gpt-oss's MXFP4 experts), stamped so that a rewrite is made once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .tiny_model import STAMP as TINY_MODEL_STAMP
from .tiny_model import building

Tensors = dict[str, Any]
"""Checkpoint tensors by name (``torch.Tensor``)."""


def source_stamp(src: Path) -> dict | str:
    """What ``src`` is: its tiny-model stamp (the architecture and seed it
    was built from), else its path."""
    stamp = src / TINY_MODEL_STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else str(src)


def rewrite_checkpoint(
    src: Path,
    dst: Path,
    convert: Callable[[str, Any], Tensors],
    update_config: Callable[[dict], None],
    stamp_name: str,
    stamp: dict,
) -> Path:
    """Write checkpoint ``src`` (one safetensors file or several with an
    index) to ``dst``, each tensor replaced by what ``convert(name, tensor)``
    returns, config.json changed by ``update_config``; stamp it."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        # Not the source's stamps (afd_*.json): dst is another model.
        is_stamp = path.name.startswith("afd_") and path.suffix == ".json"
        if path.is_file() and path.suffix != ".safetensors" and not is_stamp:
            shutil.copy(path, dst / path.name)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        out: Tensors = {}
        for name, tensor in load_file(path).items():
            out.update(convert(name, tensor))
        save_file(out, dst / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    index = src / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text()).get("metadata", {})
        text = json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))})
        (dst / index.name).write_text(text + "\n")
    config = json.loads((src / "config.json").read_text())
    update_config(config)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / stamp_name).write_text(json.dumps(stamp) + "\n")
    return dst


def ensure_rewritten(dst: Path, stamp_name: str, stamp: dict, write: Callable[[], Path]) -> Path:
    """``dst`` if it already holds the rewrite ``stamp`` names, else
    ``write()`` it (once, across processes building side by side)."""
    with building(dst):
        path = dst / stamp_name
        if path.is_file() and json.loads(path.read_text()) == stamp:
            return dst
        return write()
