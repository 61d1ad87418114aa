"""Tools for the AFD patch series over a pinned vLLM release (see apply_patches.py)."""
