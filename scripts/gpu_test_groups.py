#!/usr/bin/env python3
"""Run groups of GPU tests side by side, each in its own pytest process.

    python3 scripts/gpu_test_groups.py --logs $OUT --suite all --part 1
    python3 scripts/gpu_test_groups.py --logs $OUT --timeout 540 \\
        --group v1 0 tests/gpu/test_afd_gpu.py "V1 and ipc" \\
        --mps-group v1-mps 0 tests/gpu/test_afd_gpu.py "V1 and ipc"

The groups of ``--suite`` are tests/gpu/groups.toml's; the runner is
``vllm_afd_dev.gpu_groups`` (its docstring has the details; docs/gpu.md the
way to run it on the GPU machine).
"""

from vllm_afd_dev.gpu_groups import main

if __name__ == "__main__":
    raise SystemExit(main())
