#!/usr/bin/env bash
# GPU machine helper:
#   bash scripts/gpu_prepare.sh pack     # here: put patch-ng, pytest, torchvision (...) beside the GPU kit
#   bash scripts/gpu_prepare.sh apply    # there, after the kit is staged:
#                                        # fresh copy of stock vLLM + the series
#   bash scripts/gpu_prepare.sh models   # there: every built-in random-weight
#                                        # checkpoint the GPU tests take, FP8 and MXFP4 ones too
#   bash scripts/gpu_prepare.sh groups NAME OUTDIR TIMEOUT GROUP...
#                                        # there: groups of tests/gpu/groups.toml side by
#                                        # side, their logs packed into OUTDIR/NAME.tgz
#   KIT=.devkit-0.32.0 SITE=/tmp/site32 PRISTINE=/tmp/pristine32 \
#     bash scripts/gpu_prepare.sh stage PART   # there: another release's kit part
#                                              # (base, soC, somoe, fi), beside 0.26.0
#   KIT=.devkit-0.34.0 bash scripts/gpu_prepare.sh shrink
#                                        # here: the fi part's wheels over the 64 MiB
#                                        # a command carries, as xz tarballs
#   [KIT=.devkit-0.34.0] bash scripts/gpu_prepare.sh sparse-mla
#                                        # here: DeepGEMM and FlashMLA from the release
#                                        # wheel, for DeepSeek Sparse Attention (part `dsa`)
#   KIT=.devkit-0.34.0 bash scripts/gpu_prepare.sh cute REQUIREMENT...
#                                        # here: the CuTe DSL and QuACK wheels that vLLM
#                                        # 0.34's warm-up imports (docs/gpu.md), kit
#                                        # parts of their own (`stage cute-1`, `cute-2`)
# The GPU machine has no package index, so patch-ng and pytest travel as
# wheels in .devkit/afd (carry it with the command). The series is always laid
# over a fresh copy of the pristine tree, so patches never stack twice.
# Another release's kit comes from the shared kit's build script
# (AFD_DEVKIT_VLLM=X.Y.Z AFD_DEVKIT_FLASHINFER=... build.sh .devkit-X.Y.Z);
# `stage` unpacks its parts into SITE and PRISTINE instead of the kit's
# fixed /tmp/site, one part per command (each under the 64 MiB a command takes).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
PRISTINE=${PRISTINE:-/tmp/vllm-pristine}
LIMIT=${LIMIT:-$((60 * 1024 * 1024))}  # under the 64 MiB a command carries, with room
case "${1:?pack|apply|models|groups NAME OUTDIR TIMEOUT GROUP...|stage PART|shrink|cute REQUIREMENT...}" in
  pack)
    mkdir -p .devkit/afd
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devkit/afd \
      "patch-ng==1.19.1" pytest pluggy iniconfig pygments
    # vLLM >= 0.33 imports orjson in its CLI (so in `vllm afd-ffn`); the
    # machine's Python is 3.12 on x86-64.
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devkit/afd \
      --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 orjson
    # Qwen3.5-MoE's image processing (vLLM's Qwen3-VL processor) needs
    # torchvision, which the machine's torch 2.11 lacks.
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devkit/afd \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 torchvision==0.26.0
    # benchmarks/afd_one_gpu_overlap.py --profile-host samples the engine with py-spy.
    python3 -m pip download -q --no-deps --only-binary=:all: -d .devkit/afd \
      py-spy
    ls .devkit/afd ;;
  apply)
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .devkit/afd/*.whl
    # pip --target leaves out a wheel's scripts: py-spy's binary comes from its wheel.
    mkdir -p "$SITE/bin"
    python3 -c 'import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(".devkit/afd/py_spy-*.whl")[0])
open(sys.argv[1], "wb").write(z.read(next(n for n in z.namelist() if n.endswith("/py-spy"))))' \
      "$SITE/bin/py-spy"
    chmod +x "$SITE/bin/py-spy"
    rm -rf "$SITE/vllm"
    cp -a "$PRISTINE/vllm" "$SITE/vllm"
    PYTHONPATH="$SITE" python3 -m vllm_afd_dev.patchtool apply --vllm-dir "$SITE"
    # The development tools, for the commands run with PYTHONPATH=$SITE (the
    # benchmarks, scripts/*.py): a link to this checkout's package.
    ln -sfn "$PWD/vllm_afd_dev" "$SITE/vllm_afd_dev" ;;
  models)
    # Side by side, before any test: parallel test groups would otherwise
    # each build the same checkpoint. The generator is seeded, so these equal
    # the ones made anywhere else.
    ARCHS=$(python3 -c 'from vllm_afd_dev.models.tiny_model import ARCHITECTURES; print(*ARCHITECTURES)')
    printf '%s\n' $ARCHS | xargs -P 8 -I{} sh -c \
      'python3 -m vllm_afd_dev.models.tiny_model --arch {} --out .cache/models/tiny-$(echo {} | tr _ -) >/dev/null'
    for a in qwen3-moe deepseek-v3; do
      python3 -m vllm_afd_dev.models.fp8_checkpoint ".cache/models/tiny-$a" ".cache/models/tiny-$a-fp8"
    done
    python3 -m vllm_afd_dev.models.mxfp4_checkpoint .cache/models/tiny-gpt-oss .cache/models/tiny-gpt-oss-mxfp4
    ls .cache/models ;;
  groups)
    # There, after apply and models: groups of tests/gpu/groups.toml by name,
    # side by side in one call, their logs (and the tests' own process logs,
    # which say why a cut test hung) packed into OUTDIR as NAME.tgz.
    NAME=${2:?groups NAME OUTDIR TIMEOUT GROUP...} OUTDIR=${3:?} TIMEOUT=${4:?}
    shift 4
    LOGS=/tmp/gpu-groups/$NAME
    mkdir -p "$LOGS" && touch "$LOGS/.start"
    status=0
    PYTHONPATH="$SITE" AFD_STOCK_VLLM="$PRISTINE" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
      python3 scripts/gpu_test_groups.py --logs "$LOGS" --timeout "$TIMEOUT" --only "$@" || status=$?
    find /tmp/pytest-of-* -name '*.log' -newer "$LOGS/.start" -size -8M 2>/dev/null \
      | tar czf "$LOGS/process-logs.tgz" -T - 2>/dev/null || true
    tar czf "$OUTDIR/$NAME.tgz" -C "$LOGS" .
    exit $status ;;
  stage)
    K=${KIT:?KIT: the release kit folder, e.g. .devkit-0.32.0}
    mkdir -p "$SITE" "$PRISTINE"
    unpack() {  # xz-compressed library -> the same path in both trees
      for tree in "$SITE" "$PRISTINE"; do
        mkdir -p "$tree/vllm/$(dirname "$2")"
        xz -d -T0 -c "$1" > "$tree/vllm/$2"
      done
    }
    case "${2:?part: base | soC | somoe | fi | dsa | cute-N}" in
      base)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" "$K"/base/whl/*.whl
        rm -rf "$SITE/vllm" "$PRISTINE/vllm"
        tar xzf "$K/base/vllm_py.tar.gz" -C "$SITE"
        tar xzf "$K/base/vllm_py.tar.gz" -C "$PRISTINE" ;;
      soC) unpack "$K/soC/_C_stable_libtorch.abi3.so.xz" _C_stable_libtorch.abi3.so ;;
      somoe)
        unpack "$K/somoe/_moe_C_stable_libtorch.abi3.so.xz" _moe_C_stable_libtorch.abi3.so
        unpack "$K/somoe/_vllm_fa3_C.abi3.so.xz" vllm_flash_attn/_vllm_fa3_C.abi3.so ;;
      fi)
        # wheels as they came, and those `shrink` made tarballs of
        for whl in "$K"/fi/*.whl; do
          [ -f "$whl" ] || continue
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$whl"
        done
        for tarball in "$K"/fi/*.tar.xz; do
          if [ -f "$tarball" ]; then tar xJf "$tarball" -C "$SITE"; fi
        done ;;
      dsa)  # DeepGEMM and FlashMLA (`sparse-mla`), into both trees
        for tree in "$SITE" "$PRISTINE"; do tar xJf "$K/dsa/dsa.tar.xz" -C "$tree"; done ;;
      cute-*)
        # The CuTe DSL's tarball comes in chunks, one a command (`cute`);
        # the last one unpacks them. pip would add dsl_packages to sys.path
        # through a .pth file, which a PYTHONPATH entry does not read: put
        # $SITE/nvidia_cutlass_dsl/dsl_packages first on PYTHONPATH.
        chunks="$SITE/.cute-chunks"
        mkdir -p "$chunks"
        cp "$K/$2"/chunk.* "$chunks/"
        count=$(cat "$K/$2/count")
        if [ "$(ls "$chunks" | wc -l)" -eq "$count" ]; then
          tarball="$chunks/cute.tar"
          cat "$chunks"/chunk.* | xz -d -T0 > "$tarball"
          # A project the kit packs replaces the one an earlier part staged
          # (the DeepSeek-V4 kit's apache-tvm-ffi, vLLM 0.26.0's pin, over
          # the FlashInfer part's newer one, with which TileLang 0.1.9 fails
          # to import): the old one's files go first, as pip's uninstall
          # removes them, by its RECORD.
          for info in $(tar tf "$tarball" | sed -n 's|^\./||; s|^\([^/]*\.dist-info\)/RECORD$|\1|p'); do
            for old in "$SITE/${info%%-*}"-*.dist-info; do
              [ -d "$old" ] && [ "${old##*/}" != "$info" ] || continue
              echo "replacing ${old##*/} with $info"
              (cd "$SITE" && cut -d, -f1 "$old/RECORD" | xargs -r rm -f)
              rm -rf "$old"
            done
          done
          tar xf "$tarball" -C "$SITE"
          rm -rf "$chunks"
        fi ;;
      *) echo "unknown part $2 (base | soC | somoe | fi | dsa | cute-N)" >&2; exit 2 ;;
    esac
    echo "staged $2 of $K into $SITE" ;;
  shrink)
    # FlashInfer's wheel outgrew a command at 0.7.4 (101 MB, vLLM 0.34.0's
    # kit). A pure-Python wheel without a .data folder installs as its own
    # files, so its contents, xz-compressed (0.7.4: 25 MiB), unpack into
    # SITE as pip would install them (`stage fi`).
    K=${KIT:?KIT: the release kit folder, e.g. .devkit-0.34.0}
    for whl in "$K"/fi/*.whl; do
      [ -f "$whl" ] && [ "$(stat -c %s "$whl")" -gt "$LIMIT" ] || continue
      if unzip -Z1 "$whl" | grep -q '^[^/]*\.data/' || ! unzip -p "$whl" '*.dist-info/WHEEL' |
          grep -q '^Root-Is-Purelib: true'; then
        echo "$whl is over the limit and not a plain pure-Python wheel" >&2; exit 1
      fi
      files=$(mktemp -d)
      unzip -q "$whl" -d "$files"
      tar cf - -C "$files" . | xz -T0 -6 > "${whl%.whl}.tar.xz"
      rm -rf "$files" "$whl"
      echo "$whl -> ${whl%.whl}.tar.xz"
    done
    du -sh "$K"/* ;;
  cute)
    # vLLM 0.34 imports the CuTe DSL (`cutlass`) and QuACK's kernels in its
    # kernel warm-up on every CUDA engine, 0.26's DeepSeek-V4 them and
    # TileLang; the shared kit leaves them out.
    # The DSL's CUDA 13 library wheel (92 MB) is over what a command
    # carries, so the x86-64 files of the wheels named (pip requirements,
    # from the release wheel's Requires-Dist, each without its
    # dependencies) travel as one xz tarball, less the other platforms'
    # stubs and the static archive.
    K=${KIT:?KIT: the release kit folder, e.g. .devkit-0.34.0}
    shift
    [ $# -gt 0 ] || { echo "cute: name the wheels, e.g. nvidia-cutlass-dsl==4.8.0 ..." >&2; exit 2; }
    wheels=$(mktemp -d) files=$(mktemp -d)
    for req in "$@"; do
      # z3-solver (TileLang's) is tagged only manylinux2014, which pip does
      # not count under manylinux_2_28.
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$wheels" "$req"
    done
    for whl in "$wheels"/*.whl; do unzip -q -o "$whl" -d "$files"; done
    rm -rf "$files"/nvidia_cutlass_dsl/cu13/lib/stubs "$files"/nvidia_cutlass_dsl/cu13/lib/*.a
    echo "compressing $* (a few minutes)"
    tar cf - -C "$files" . | xz -T0 -6 > "$wheels/cute.tar.xz"
    # Compressed it is still over what one command carries: parts cute-1,
    # cute-2, ... of one chunk each, staged in order.
    rm -rf "$K"/cute-*
    split -b "$LIMIT" -d -a 2 "$wheels/cute.tar.xz" "$wheels/chunk."
    count=$(ls "$wheels"/chunk.* | wc -l)
    n=0
    for chunk in "$wheels"/chunk.*; do
      n=$((n + 1))
      mkdir -p "$K/cute-$n"
      mv "$chunk" "$K/cute-$n/"
      echo "$count" > "$K/cute-$n/count"
    done
    rm -rf "$wheels" "$files"
    du -sh "$K"/cute-* ;;
  sparse-mla)
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on SM90: the indexer
    # runs DeepGEMM's kernels, the FP8 KV cache FlashMLA's sparse ones. The
    # release wheel has both (vllm/third_party/deep_gemm, vllm/_flashmla*_C),
    # which the shared kit leaves out: part `dsa`, staged after `base`. The
    # GPU machine's Python is 3.12.
    K=${KIT:-.devkit}
    version=$(tar xzf "$K/base/vllm_py.tar.gz" --wildcards -O 'vllm-*.dist-info/METADATA' \
      | sed -n 's/^Version: //p')
    wheel=$(ls "${AFD_DEVKIT_CACHE:-$HOME/.cache/afd-devkit}"/vllm-"$version"-*.whl | head -1)
    files=$(mktemp -d)
    unzip -q "$wheel" 'vllm/third_party/deep_gemm/*' 'vllm/_flashmla_C.abi3.so' \
      'vllm/_flashmla_extension_C.abi3.so' \
      -x 'vllm/third_party/deep_gemm/_C.cpython-31[!2]-*' -d "$files"
    mkdir -p "$K/dsa"
    tar cf - -C "$files" vllm | xz -T0 -6 > "$K/dsa/dsa.tar.xz"
    rm -rf "$files"
    du -sh "$K/dsa" ;;
  *) echo "unknown step $1 (pack | apply | models | groups NAME OUTDIR TIMEOUT GROUP... | stage PART | shrink | cute REQUIREMENT... | sparse-mla)" >&2; exit 2 ;;
esac
