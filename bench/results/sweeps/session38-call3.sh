#!/usr/bin/env bash
# Session 38, calls 3 and 4 (H100; call 3 named no deformops variant, so it ran none, and
# stopped the fuzz at 270 s with 3 of 4 passed): the bench of record's cells with deformops 3.0.1 (a pure-Python
# wheel whose CUDA default is its Triton backend, carried in .whl/), alone on the GPU; then the
# GPU fuzz at its default 500 examples a dtype in 4 processes (not run since entry 79's merge).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 200 python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic deformops \
  --peers deformops --out "$OUT/bench" >"$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "peers|run complete" "$OUT/bench.log"
t0=$SECONDS
timeout $((560 - SECONDS)) python3 -m pytest -v -p no:cacheprovider -n 4 -rfEs --durations=5 tests/gpu/test_gpu_fuzz.py \
  >"$OUT/fuzz.log" 2>&1
echo "fuzz exit $? after $((SECONDS - t0)) s"; tail -4 "$OUT/fuzz.log"
