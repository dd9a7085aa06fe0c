#!/usr/bin/env bash
# The prepared run for a lent GPU (issue 30): the smoke test on one process, then the one-GPU offload benchmark.
# Usage, from the repository root on the GPU machine: OUT=out bash bench/gpu_session.sh   (about 6 minutes on an H100)
# Everything goes to $OUT (logs and JSON); the last lines printed are the tables.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 || echo "pip install failed (PYTHONPATH is used instead)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp;
  python -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)"; } \
  >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 180 torchrun --nproc_per_node 1 tests/gpu/smoke.py --out "$OUT/smoke.json" >"$OUT/smoke.log" 2>&1
echo "smoke exit $?"; grep -E "^  (ok|FAIL)" "$OUT/smoke.log" | grep -v ": skipped$"
grep -E "Error|Traceback" "$OUT/smoke.log" | head -5
timeout 220 python bench/gpu_offload.py --steps 3 --modes none cpu cpu+param "cpu/1 thread" \
  --json "$OUT/gpu_offload.json" >"$OUT/gpu_offload.log" 2>&1
echo "gpu_offload exit $?"
timeout 100 python bench/gpu_offload.py --hidden 1024 --layers 8 --steps 3 --modes none nvme \
  --json "$OUT/gpu_offload_nvme.json" >"$OUT/gpu_offload_nvme.log" 2>&1
echo "gpu_offload nvme exit $?"
grep -E "^\||^gpu_offload" "$OUT/gpu_offload.log" "$OUT/gpu_offload_nvme.log"
grep -h '"error"' "$OUT"/gpu_offload*.log | cut -c1-1500
