"""The GPU tests: every test here is marked ``gpu`` and skips without CUDA.

Their engine settings, placements and GPU-count marks are
``vllm_afd_dev.harness.gpu_settings``; ``tests/gpu/groups.toml`` lists the
groups that scripts/gpu_test_groups.py runs side by side (docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Before -m selects (the mark plugin's own hook), so that `-m gpu` finds them.
    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(no_cuda)
