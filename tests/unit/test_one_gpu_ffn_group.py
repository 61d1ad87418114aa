"""The one-GPU FFN group placement (``vllm_afd_dev.harness.one_gpu_ffn_group``)
names each group process a host of its own for NCCL. The server spawns
those processes, and a spawned process runs the function it was given
from a fresh import: the placement must reach it there."""

from __future__ import annotations

import subprocess
import sys

# What multiprocessing's spawn does in a child started from `python -m MODULE`
# (multiprocessing.spawn._fixup_main_from_name) before it runs its target.
AS_A_SPAWNED_CHILD = """
import runpy
import vllm.afd.ffn.server as server
runpy.run_module("vllm_afd_dev.harness.one_gpu_ffn_group", run_name="__mp_main__")
print(server.run_ffn_rank.__name__)
"""


def test_a_spawned_group_process_runs_the_placement():
    child = subprocess.run(
        [sys.executable, "-c", AS_A_SPAWNED_CHILD], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-1] == "run_ffn_rank_as_its_own_host"
