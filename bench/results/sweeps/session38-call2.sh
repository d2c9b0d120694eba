#!/usr/bin/env bash
# Session 38, call 2 (an H100 this time; every bench of record so far ran on an H200): the bench
# of record's command with the peers it can import, alone on the GPU; then racecheck and
# initcheck over the encoder preset's backward (the decoder's passed in session 36).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 330 python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic \
  --out "$OUT/bench" >"$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/bench.log"
t0=$SECONDS
timeout 110 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
  python3 scripts/sanitize_backward.py --preset encoder >"$OUT/racecheck.log" 2>&1
echo "racecheck exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/racecheck.log"
t0=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 110 compute-sanitizer --tool initcheck --error-exitcode 1 \
  python3 scripts/sanitize_backward.py --preset encoder >"$OUT/initcheck.log" 2>&1
echo "initcheck exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/initcheck.log"
