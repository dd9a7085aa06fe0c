#!/usr/bin/env bash
# Installs (once) and runs the test suite: unit tests and multi-process gloo tests on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${VENV:-.venv}/bin/python" -m pytest tests "$@"
