#!/usr/bin/env python3
"""Rewrite a checkpoint with FP8 block-quantized weights, as DeepSeek-V3 ships.

    python scripts/fp8_checkpoint.py SRC DST [--block 128 128]

The rewrite is ``vllm_afd_dev.models.fp8_checkpoint`` (its docstring says
what changes; ``scripts/setup_env.sh`` installs the package).
"""

from vllm_afd_dev.models.fp8_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
