#!/usr/bin/env bash
# Issue 14's model-level rows on the H200: bench.detr (a transformers Deformable DETR, ResNet-50,
# random weights, 800x1333, batch 2, stock against patched), in parts, each under its own timeout
# so that one slow compile leaves the other parts' files:
#   detr-h200.sh [eager] [compiled-float32] [compiled-bfloat16-inference] [compiled-bfloat16-training]
# Session 35 ran `eager` and the compiled float32 inference row; session 36 the float32 training
# row alone (207 s), then `compiled-bfloat16-inference` and `compiled-bfloat16-training` (232 s)
# in two calls, then `eager` again at 30 steps (`eager30`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
run() {  # run NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m bench.detr "$@" --out "$OUT/detr-$name.md" 2>&1 | grep -v -i warn | tail -8
  echo "$name: $((SECONDS - t0)) s"
}
for part in "$@"; do
  case $part in
    eager) run eager 200 --modes eager ;;
    eager30) run eager-30-steps 200 --modes eager --steps 30 ;;
    compiled-float32) run compiled-float32 480 --modes compiled --precisions float32 ;;
    compiled-float32-training) run compiled-float32-training 300 --modes compiled --precisions float32 --kinds training ;;
    compiled-bfloat16-inference) run compiled-bfloat16 250 --modes compiled --precisions bfloat16 --kinds inference ;;
    compiled-bfloat16-training) run compiled-bfloat16-training 360 --modes compiled --precisions bfloat16 --kinds training ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
