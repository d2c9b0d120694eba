#!/usr/bin/env bash
# Session 42, call 2: the bench of record's cells at 6ffd571 (no kernel change since the
# session-38 H100 bench; the eager paths, the CPU path and the tests changed) with deformops 3.0.1
# beside msda, alone on the GPU; then `python -m bench.calls` (issue 14's rows); then the GPU fuzz
# at its default 500 examples a dtype in 4 processes (not run since entry 83).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 220 python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic deformops \
  --peers deformops --out "$OUT/bench" >"$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "peers|rows in" "$OUT/bench.log"
t0=$SECONDS
timeout 120 python3 -m bench.calls >"$OUT/calls.log" 2>&1
echo "calls exit $? after $((SECONDS - t0)) s"; cat "$OUT/calls.log" | tail -25
t0=$SECONDS
timeout $((570 - SECONDS)) python3 -m pytest -v -p no:cacheprovider -n 4 -rfEs --durations=5 tests/gpu/test_gpu_fuzz.py \
  >"$OUT/fuzz.log" 2>&1
echo "fuzz exit $? after $((SECONDS - t0)) s"; tail -4 "$OUT/fuzz.log"
