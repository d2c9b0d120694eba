#!/usr/bin/env bash
# Session 45, call 3 (the session's last device time): entry 97's fix of the GPU fuzz's bfloat16
# counterexample (replicas at any density, the lane placement adding into them, the fold's
# runs). First the A/B against HEAD's rules alone on the GPU (session45-always_replicas.py),
# then, side by side, the parts of the GPU tier the change touches: the numerics at both presets
# and the new counterexample test, the fuzz at 50 examples a dtype, and the kernels' CPU-tier
# tests on CUDA. Not the whole tier: under 500 s of device time were left.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1 MSDA_GPU_FUZZ_EXAMPLES=50
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 100 python3 bench/results/sweeps/session45-always_replicas.py >"$OUT/always_replicas.log" 2>&1
echo "always_replicas exit $? after $((SECONDS - t0)) s"
left=$((300 - SECONDS))
run() { local name=$1; shift; timeout $left python3 -m pytest "$@" -q -rfEs -p no:cacheprovider >"$OUT/$name.log" 2>&1; echo "== $name exit $?: $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1)"; }
run numerics tests/gpu/test_gpu_numerics.py -k "preset_matches or levels_of_a_pixel or accumulation_rule" &
run fuzz tests/gpu/test_gpu_fuzz.py &
run kernels tests/test_triton_kernels.py tests/test_direct_launch.py tests/gpu/test_gpu_compile.py -n 4 &
wait
echo "all done after $SECONDS s"
