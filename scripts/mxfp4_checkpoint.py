#!/usr/bin/env python3
"""Rewrite a gpt-oss checkpoint with its experts in MXFP4, as gpt-oss ships.

    python scripts/mxfp4_checkpoint.py SRC DST

The rewrite is ``vllm_afd_dev.models.mxfp4_checkpoint`` (its docstring says
what changes; ``scripts/setup_env.sh`` installs the package).
"""

from vllm_afd_dev.models.mxfp4_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
