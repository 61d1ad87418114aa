#!/usr/bin/env bash
# The project's test command: set up (idempotent), lint, check the series
# against the pinned vLLM, run the test suite. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> patch series against the pinned vLLM"
.venv/bin/python scripts/apply_patches.py check
echo "==> pytest"
.venv/bin/python -m pytest "$@"
