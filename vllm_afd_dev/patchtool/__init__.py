"""Tools for the AFD patch series over a pinned vLLM release.

Their command is ``scripts/apply_patches.py`` (``cli``), also
``python -m vllm_afd_dev.patchtool`` from the repository root, which needs
nothing installed but patch-ng and packaging.
"""
