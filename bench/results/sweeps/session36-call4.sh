#!/usr/bin/env bash
# Session 36, call 4: checks not run since the prepared backward's merge (0fb54a3): the GPU fuzz
# at 200 examples a dtype (500 took 237 s in session 32: more than the device time left), beside
# it (as load) the CPU smoke bench whose derived backward now gets more rounds, then racecheck
# and initcheck over the decoder preset's backward.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
MSDA_GPU_FUZZ_EXAMPLES=200 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rfEs --durations=5 \
  tests/gpu/test_gpu_fuzz.py >"$OUT/fuzz.log" 2>&1 &
fuzz=$!
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_bench.py -k "smoke_preset or derived" \
  >"$OUT/smoke.log" 2>&1
echo "smoke exit $?"; tail -3 "$OUT/smoke.log"
wait $fuzz; echo "fuzz exit $? after $((SECONDS - t0)) s"; tail -4 "$OUT/fuzz.log"
t0=$SECONDS
timeout 40 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
  python3 scripts/sanitize_backward.py --preset decoder >"$OUT/racecheck.log" 2>&1
echo "racecheck exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/racecheck.log"
t0=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 30 compute-sanitizer --tool initcheck --error-exitcode 1 \
  python3 scripts/sanitize_backward.py --preset decoder >"$OUT/initcheck.log" 2>&1
echo "initcheck exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/initcheck.log"
