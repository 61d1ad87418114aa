"""vLLM-AFD's development tools, as one package.

- ``harness``: launching AFD and stock vLLM runs in fresh processes, what the
  tests and the benchmarks share (``generate``: greedy generation and its
  worker process; ``launch``: FFN ranks, servers, kills; ``gpu_settings``;
  ``net_hosts``);
- ``models``: the built-in tiny checkpoints (``tiny_model``) and their FP8
  form (``fp8_checkpoint``);
- ``patchtool``: the patch series tool (``scripts/apply_patches.py``);
- ``bench``: what the benchmarks share with each other and with the tests
  (results files, model shapes, the roofline, the performance model, host
  profiles, graph timing, GPU memory settings);
- ``gpu_groups``: the GPU test groups (``tests/gpu/groups.toml``).

``scripts/setup_env.sh`` installs it into the venv (``pip install -e .
--no-deps``); the commands in ``scripts/`` are thin files that call into it.
Nothing here is imported by vLLM or by the patched tree.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the package is installed editable, from here)."""
MODELS = ROOT / ".cache" / "models"
"""Where the built-in tiny checkpoints are made."""
