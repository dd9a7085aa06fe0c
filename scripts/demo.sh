#!/usr/bin/env bash
# Installs (once) and trains a tiny Llama with ZeRO stage 2 on 2 CPU processes, printing loss and memory per rank.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29533}" recipes/demo_engine.py "$@"
