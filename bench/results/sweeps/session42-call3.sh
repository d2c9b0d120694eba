#!/usr/bin/env bash
# Session 42, call 3: racecheck and initcheck over the backward at both presets, every dtype
# (scripts/sanitize_backward.py; not run since session 38's encoder and session 36's decoder),
# a dtype a process, four at a time.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
status=0
for tool in racecheck initcheck; do
  t0=$SECONDS; pids=()
  for dtype in float32 float16 bfloat16 float64; do
    if [ $tool = racecheck ]; then
      compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
        python3 scripts/sanitize_backward.py --dtype $dtype >"$OUT/$tool-$dtype.log" 2>&1 & pids+=($!)
    else
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --error-exitcode 1 \
        python3 scripts/sanitize_backward.py --dtype $dtype >"$OUT/$tool-$dtype.log" 2>&1 & pids+=($!)
    fi
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}"; rc=$?; [ $rc = 0 ] || status=$rc; done
  echo "$tool: $((SECONDS - t0)) s"
  for f in "$OUT"/$tool-*.log; do echo "  $(basename $f): $(grep -E 'SUMMARY|Error|error' "$f" | tail -2 | tr '\n' ' ')"; done
done
echo "exit $status"; exit $status
