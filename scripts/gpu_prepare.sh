#!/usr/bin/env bash
# GPU machine helper, in two halves:
#   bash scripts/gpu_prepare.sh pack     # here: put patch-ng and pytest beside the GPU kit
#   bash scripts/gpu_prepare.sh apply    # there, after the kit is staged:
#                                        # fresh copy of stock vLLM + the series
# The GPU machine has no package index, so patch-ng and pytest travel as
# wheels in .devkit/afd (carry it with the command). The series is always laid over a
# fresh copy of /tmp/vllm-pristine, so patches never stack twice.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
case "${1:?pack|apply}" in
  pack)
    mkdir -p .devkit/afd
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devkit/afd \
      "patch-ng==1.19.1" pytest pluggy iniconfig pygments
    ls .devkit/afd ;;
  apply)
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .devkit/afd/*.whl
    rm -rf "$SITE/vllm"
    cp -a /tmp/vllm-pristine/vllm "$SITE/vllm"
    PYTHONPATH="$SITE" python3 scripts/apply_patches.py apply --vllm-dir "$SITE" ;;
  *) echo "unknown step $1 (pack | apply)" >&2; exit 2 ;;
esac
