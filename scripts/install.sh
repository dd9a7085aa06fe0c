#!/usr/bin/env bash
# Creates .venv (if missing) and installs accelerate_zero with its test and qlora extras into it.
# Prints a line per phase and pip's own progress (minutes on a fresh machine: torch alone is a large download).
# torch is pinned first (TORCH_SPEC). On PyPI that is the default build: with CUDA on Linux, plus the nvidia-*
# packages, on a machine with or without a GPU. For the smaller CPU-only build on a machine without a GPU, set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (PyTorch's CPU wheel index). GPU machines keep the default.
# The test extra includes deepspeed (tests/integration/test_migration.py runs accelerate's own `accelerate launch`
# with a DEEPSPEED config, which accelerate refuses without it); it is built with DS_BUILD_OPS=0: no op is compiled,
# and accelerate_zero never imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
export DS_BUILD_OPS=0

# pip repeats "WARNING: Location '...' is ignored" for every package when an index in the user's pip config is
# unreachable: hundreds of lines that bury the progress; everything else pip prints is kept.
pip_install() {
    "$VENV/bin/pip" install "$@" 2>&1 | { grep --line-buffered -v "^WARNING: Location '.*' is ignored" || true; }
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[install] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
# The packages are looked up, not imported (importing them takes seconds of CPU, paid by every `scripts/test.sh`);
# a .venv made before deepspeed joined the test extra gets it
HAS_ALL="import sys; from importlib.metadata import version; from importlib.util import find_spec; version('deepspeed')
sys.exit(any(find_spec(name) is None for name in ('torch', 'accelerate_zero', 'pytest', 'bitsandbytes', 'trl')))"
if "$VENV/bin/python" -c "$HAS_ALL" >/dev/null 2>&1; then
    echo "[install] $VENV already has accelerate_zero and its extras (delete $VENV to reinstall)"
    exit 0
fi
start=$SECONDS
echo "[install] 1/3 upgrading pip"
pip_install --quiet --upgrade pip
echo "[install] 2/3 installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (the largest download)"
if [ -n "$TORCH_INDEX_URL" ]; then
    pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
else
    pip_install "$TORCH_SPEC"
fi
echo "[install] 3/3 installing accelerate_zero with the test and qlora extras (transformers, accelerate, trl, deepspeed" \
    "without its ops, ...)"
pip_install -e ".[test,qlora]"
echo "[install] done in $((SECONDS - start)) s"
