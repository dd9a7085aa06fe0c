#!/usr/bin/env bash
# Creates .venv (if missing) and installs accelerate_zero with its test dependencies into it.
# torch is pinned first: an unpinned torch makes pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import accelerate_zero, pytest, bitsandbytes, trl" >/dev/null 2>&1; then
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "$TORCH_SPEC"
    "$VENV/bin/pip" install --quiet -e ".[test,qlora]"
fi
