#!/usr/bin/env bash
# Session 36, call 3: the compiled bfloat16 autocast training step (call 2's 250 s stopped in it),
# then the eager rows again with 30 steps a row (session 35's two hosts disagreed: 1.80x / 1.23x).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
run() {  # run NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m bench.detr "$@" --out "$OUT/$name.md" 2>&1 | grep -v -i warn | tail -8
  echo "$name: $((SECONDS - t0)) s"
}
run detr-compiled-bfloat16-training 360 --modes compiled --precisions bfloat16 --kinds training
run detr-eager-30-steps 170 --modes eager --steps 30
