#!/usr/bin/env bash
# The prepared run for a lent GPU: ours, DeepSpeed 0.19.8 and FSDP2 per offload mode (bench/gpu_compare.py), the
# smoke test, host AdamW, compile (bench/README.md, "Offload side by side on one GPU").
# Usage (every part, DRY=1, BUDGET, LARGE_LAYERS, WHEELS_DIR): bench/README.md, "Offload side by side on one GPU".
#   OUT=out PARTS="smoke 1b nvme" BUDGET=780 timeout 900 bash bench/gpu_compare.sh   # a 15-minute lent session
set -uo pipefail
OUT=${OUT:-bench/out/gpu_compare}
PARTS=${PARTS:-1b}
BUDGET=${BUDGET:-480}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
left() { echo $((BUDGET - SECONDS)); }

read -r -a systems <<<"${SYSTEMS:-ours deepspeed fsdp2}"
extra=()
if [ -n "${DRY:-}" ]; then extra=(--dry_run); fi  # the dry run installs nothing into the caller's Python
if [ -z "${DRY:-}" ]; then
  $PY -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 \
    || echo "pip install -e . failed (PYTHONPATH is used instead)"
fi
WHEELS=""
for folder in ${WHEELS_DIR:-} ../shared/gpu-wheels shared/gpu-wheels; do
  if [ -z "${DRY:-}" ] && [ -d "$folder" ]; then WHEELS=$folder; break; fi
done
if [ -n "${DRY:-}" ]; then
  echo "dry run: nothing installed"
elif [ -n "$WHEELS" ]; then
  $PY -m pip install --no-deps -q "$WHEELS"/*.whl >>"$OUT/install.log" 2>&1 || echo "wheel install failed: $OUT/install.log"
else
  echo "no gpu-wheels folder (set WHEELS_DIR): the DeepSpeed rows will say it is not installed"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo "cores: $(nproc)"; free -g | head -2;
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)";
  $PY -c "import deepspeed, trl; print('deepspeed', deepspeed.__version__, 'trl', trl.__version__)";
  git log -1 --format='commit %h %s' 2>/dev/null; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# DeepSpeed's cpu_adam compiles on first use (about a minute): once here, not inside a timed run's timeout.
if [ -z "${DRY:-}" ] && $PY -c "import deepspeed" 2>/dev/null; then
  timeout 240 $PY -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    >"$OUT/ds_cpu_adam_build.log" 2>&1
  echo "DeepSpeed cpu_adam build: exit $? at ${SECONDS}s"
fi

for part in $PARTS; do
  case $part in
    1b) options=(--hidden 2048 --layers 16 --batch 4 --seq 1024 --accumulation 4 --steps 2 --timeout 150
                 --modes cpu none cpu/sync cpu+param cpu/omp1 cpu/host1 --label "~1B") ;;
    large) layers=${LARGE_LAYERS:-24}
           if [ "$layers" = largest ]; then
             gib=$(free -g | awk '/^Mem:/ {print $2}')
             layers=$($PY bench/gpu_compare.py --hidden 4096 --batch 2 --largest --cpu_gib "$gib" 2>/dev/null \
                      | sed -n 's/^cpu+param: \([0-9]*\) layers.*/\1/p')
             echo "the estimator's largest for cpu+param with ${gib} GiB of RAM: ${layers:-?} layers"
             layers=${layers:-24}
           fi
           options=(--hidden 4096 --layers "$layers" --batch 2 --seq 1024 --accumulation 1 --steps 2
                    --timeout 200 --modes cpu+param --label "large") ;;
    nvme) options=(--hidden 1024 --layers 8 --batch 4 --seq 1024 --accumulation 1 --steps 2 --timeout 120
                   --modes nvme none --nvme_dir "${NVME_DIR:-/tmp/gpu_compare_nvme}" --label "NVMe")
          mkdir -p "${NVME_DIR:-/tmp/gpu_compare_nvme}" ;;
    smoke) # tests/gpu/smoke.py on one process: every check asserted (its docstring lists them)
          if [ -n "${DRY:-}" ] || [ "$(left)" -lt 200 ]; then echo "part smoke: skipped (dry run or $(left) s left)"; continue; fi
          timeout 180 $PY -m torch.distributed.run --nproc_per_node 1 tests/gpu/smoke.py --out "$OUT/smoke.json" \
            >"$OUT/smoke.log" 2>&1
          echo "part smoke: exit $? at ${SECONDS}s"; grep -E "^  (ok|FAIL)" "$OUT/smoke.log" | grep -v ": skipped$"
          grep -E "Error|Traceback" "$OUT/smoke.log" | head -5
          continue ;;
    adam) # bench/host_adam.py runs DeepSpeed from a virtualenv folder: here DeepSpeed is in $PY itself
          mkdir -p "$OUT/adam/python/bin"
          printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" >"$OUT/adam/python/bin/python"
          chmod +x "$OUT/adam/python/bin/python"
          if [ "$(left)" -lt 60 ]; then echo "part adam: skipped, $(left) s of the budget left"; continue; fi
          timeout "$(( $(left) - 10 ))" $PY bench/host_adam.py --impl ours torch-fused deepspeed --threads "$(nproc)" \
            --numel 50000000 --steps 10 --repeats 1 --ds_venv "$OUT/adam/python" --json "$OUT/adam/host_adam.json" \
            >"$OUT/adam.log" 2>&1
          echo "part adam: exit $? at ${SECONDS}s"; tail -8 "$OUT/adam.log"; rm -f "$OUT/adam/python/bin/python"
          continue ;;
    compile) # issue 51: eager vs torch.compile (inductor), ours at stages 0-3, DDP, FSDP2; one GPU, so W=1
          if [ "$(left)" -lt 60 ]; then echo "part compile: skipped, $(left) s of the budget left"; continue; fi
          size=(--hidden 2048 --layers 8 --vocab 32000 --seq 1024 --batch 4); [ -n "${DRY:-}" ] && size=(--hidden 64 --layers 1 --vocab 256 --seq 16 --batch 2)
          device=cuda; [ -n "${DRY:-}" ] && device=cpu
          timeout "$(( $(left) - 10 ))" $PY bench/compile_bench.py --device "$device" --world_sizes 1 "${size[@]}" \
            --rounds 3 --steps 5 --warmup 3 --json "$OUT/compile.json" >"$OUT/compile.log" 2>&1
          echo "part compile: exit $? at ${SECONDS}s"; grep '^|\|^W = \|^compile_bench' "$OUT/compile.log"
          continue ;;
    *) echo "unknown part $part (choose from smoke 1b large nvme adam compile)"; continue ;;
  esac
  if [ "$(left)" -lt 60 ]; then echo "part $part: skipped, $(left) s of the budget left"; continue; fi
  $PY bench/gpu_compare.py "${options[@]}" ${extra[@]+"${extra[@]}"} --systems "${systems[@]}" --budget "$(( $(left) - 15 ))" \
    --out "$OUT/$part" \
    >"$OUT/$part.log" 2>&1
  echo "part $part: exit $? at ${SECONDS}s"
done
for part in $PARTS; do
  [ -f "$OUT/$part/table.md" ] && cat "$OUT/$part/table.md" && ls "$OUT/$part"/timeline_* 2>/dev/null
done
grep -h '"error"' "$OUT"/*.log 2>/dev/null | cut -c1-1200 || true  # no error line is not a failure
