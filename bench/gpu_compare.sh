#!/usr/bin/env bash
# The prepared side-by-side run for a lent GPU (issue 40): ours, DeepSpeed 0.19.8 and FSDP2 per offload mode
# (bench/gpu_compare.py; its docstring says what each system runs and what is measured).
# Usage, from the repository root on the GPU machine (no registry needed):
#   OUT=out bash bench/gpu_compare.sh            # part 1b: ~1B, modes cpu, none, cpu/sync, cpu+param, cpu/omp1
#   OUT=out PARTS=large bash bench/gpu_compare.sh  # 5.1B (hidden 4096 x LARGE_LAYERS=24), cpu+param (~5 min)
#     LARGE_LAYERS=largest: the estimator's largest for cpu+param on this machine (bench/gpu_offload.py --largest)
#   OUT=out PARTS=nvme bash bench/gpu_compare.sh   # 0.17B, modes none and nvme (the file I/O lane)
#   OUT=out PARTS=adam bash bench/gpu_compare.sh   # host AdamW: ours vs DeepSpeed's cpu_adam on all cores (~3 min)
#   OUT=out PARTS=compile bash bench/gpu_compare.sh  # eager vs torch.compile, ours 0-3, DDP, FSDP2 (bench/compile_bench.py)
#   DRY=1 PYTHON=.venv/bin/python SYSTEMS="ours fsdp2" PARTS="1b nvme" bash bench/gpu_compare.sh  # CPU, tiny, no installs
# BUDGET (default 480 s) caps the whole script: a run that would start past it is recorded as skipped, and each
# run's timeout is cut to what is left, so a session keeps time to rerun. Everything goes to $OUT; the tables
# (also in $OUT/<part>/table.md) and the timelines ($OUT/<part>/timeline_*.svg|png) are printed/listed last.
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
                 --modes cpu none cpu/sync cpu+param cpu/omp1 --label "~1B") ;;
    large) layers=${LARGE_LAYERS:-24}
           if [ "$layers" = largest ]; then
             gib=$(free -g | awk '/^Mem:/ {print $2}')
             layers=$($PY bench/gpu_offload.py --hidden 4096 --batch 2 --largest --cpu_gib "$gib" 2>/dev/null \
                      | sed -n 's/^cpu+param: \([0-9]*\) layers.*/\1/p')
             echo "the estimator's largest for cpu+param with ${gib} GiB of RAM: ${layers:-?} layers"
             layers=${layers:-24}
           fi
           options=(--hidden 4096 --layers "$layers" --batch 2 --seq 1024 --accumulation 1 --steps 2
                    --timeout 200 --modes cpu+param --label "large") ;;
    nvme) options=(--hidden 1024 --layers 8 --batch 4 --seq 1024 --accumulation 1 --steps 2 --timeout 120
                   --modes nvme none --nvme_dir "${NVME_DIR:-/tmp/gpu_compare_nvme}" --label "NVMe")
          mkdir -p "${NVME_DIR:-/tmp/gpu_compare_nvme}" ;;
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
          echo "part compile: exit $? at ${SECONDS}s"; grep '^|\|^W=\|^model' "$OUT/compile.log"
          continue ;;
    *) echo "unknown part $part (choose from 1b large nvme adam compile)"; continue ;;
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
grep -h '"error"' "$OUT"/*.log 2>/dev/null | cut -c1-1200
