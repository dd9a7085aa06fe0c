#!/usr/bin/env bash
# Installs (once) and runs the test suite: unit tests and multi-process gloo tests on the CPU, then lists the
# 20 slowest tests. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` (the fast tier).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The suite starts many Python processes (pooled ranks, launches) that import this checkout's modules: compile
# them once here (stale files only), or where PYTHONDONTWRITEBYTECODE is set every process compiles them again.
"${VENV:-.venv}/bin/python" -m compileall -q -j 0 accelerate_zero tests recipes bench
exec "${VENV:-.venv}/bin/python" -m pytest tests --durations=20 "$@"
