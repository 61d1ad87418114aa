"""``python -m vllm_afd_dev.patchtool COMMAND``: ``scripts/apply_patches.py``."""

from vllm_afd_dev.patchtool.cli import main

raise SystemExit(main(prog="python -m vllm_afd_dev.patchtool"))
