#!/usr/bin/env bash
# Installs (once), then runs the SFT demo: the embedded tiny Llama learns the "letters" puzzles with ZeRO stage 3
# on 2 CPU processes, and prints its held-out exact-match accuracy before and after training (recipes/README.md).
# Extra arguments override the demo config, e.g. `bash scripts/demo.sh --max_steps 100`.
# VENV=path uses (and installs into) another virtual environment than .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="${VENV:-$PWD/.venv}/bin:$PATH"
exec accelerate-zero launch --config_file accelerate_configs/zero3_demo.yaml recipes/sft.py --config recipes/configs/sft_demo.yaml "$@"
