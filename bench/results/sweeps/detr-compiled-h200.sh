#!/usr/bin/env bash
# Issue 14's compiled model-level rows on the H200 (session 36): bench.detr's compiled training
# step in float32 (the 400 s call of session 35 stopped there), then the compiled bfloat16
# autocast rows, each under its own timeout so that one slow compile leaves the others' files.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
run() {  # run NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m bench.detr "$@" --out "$OUT/$name.md" 2>&1 | grep -v -i warn | tail -8
  echo "$name: $((SECONDS - t0)) s"
}
run detr-compiled-float32-training 300 --modes compiled --precisions float32 --kinds training
run detr-compiled-bfloat16 250 --modes compiled --precisions bfloat16
