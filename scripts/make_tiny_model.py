#!/usr/bin/env python3
"""Generate a built-in tiny model: random weights, own tokenizer.

    python scripts/make_tiny_model.py --arch qwen3 --out .cache/models/tiny-qwen3

The generator is ``vllm_afd_dev.models.tiny_model`` (its docstring says what
the checkpoints hold; ``scripts/setup_env.sh`` installs the package).
"""

from vllm_afd_dev.models.tiny_model import main

if __name__ == "__main__":
    raise SystemExit(main())
