#!/usr/bin/env bash
# One device call: the GPU test tier, then the benchmark (or the launch-config sweep).
#   scripts/gpu_session.sh [tier|tests[:PATHS]|sanitize|sanitize_backward|tune|bench|mod:MODULE ...]   (default: tier bench)
# `tier` runs the GPU tier in four concurrent pytest processes plus the sanitizer (Triton and
# inductor compiles are CPU-bound: about 3x faster than one process). Never time things beside it.
# Logs go to $OUT when it is set (the device tool), else to ./gpu-logs.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (expecttest, peers)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0

# pytest-xdist (-n) and pytest-timeout (--timeout) come with the test group (pip install -e . --group
# test; on a machine without network, carry their wheels in .whl/). Without them the tier still
# runs: the CPU tests in one process, and no test is stopped for taking too long.
parallel=(-n 6)
python3 -c "import xdist" 2>/dev/null || { parallel=(); echo "note: pytest-xdist is not installed: no -n"; }
timeouts=true
python3 -c "import pytest_timeout" 2>/dev/null || { timeouts=false; echo "note: pytest-timeout is not installed: no --timeout"; }

pytest_log() {  # pytest_log NAME TIMEOUT_S ARGS...: one pytest process, its output in $out/NAME.log
  local name=$1 limit=$2; shift 2
  if $timeouts; then set -- "$@" --timeout="$limit"; fi
  python3 -m pytest "$@" -q -rfEs --durations=10 -p no:cacheprovider >"$out/$name.log" 2>&1
}

sanitize() {  # memcheck over the kernels' edge shapes, racecheck over the shared tile's; nonzero exit on any error
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize.py \
    && compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 python3 scripts/sanitize.py --shared-tile-only
}

tier() {
  local pids=() names=(gpu_bad_input gpu_graphs gpu_numerics gpu_contract gpu_fuzz rest sanitize) i s=0 pid rc done_count=0
  # The fuzz's default, 500 examples a dtype, takes over 9 minutes on one H200: past a 10-minute
  # device call with the rest (MSDA_GPU_FUZZ_EXAMPLES=50 fits; run the 500 on their own).
  echo "fuzz: ${MSDA_GPU_FUZZ_EXAMPLES:-500} examples a dtype (MSDA_GPU_FUZZ_EXAMPLES)"
  pytest_log gpu_bad_input 300 tests/gpu/test_gpu_bad_input.py & pids+=($!)
  pytest_log gpu_graphs 300 tests/gpu/test_gpu_compile.py tests/gpu/test_gpu_cuda_graphs.py tests/gpu/test_gpu_export.py & pids+=($!)
  pytest_log gpu_numerics 300 tests/gpu/test_gpu_numerics.py tests/gpu/test_gpu_opcheck.py tests/gpu/test_gpu_streams.py \
    tests/gpu/test_gpu_two_devices.py tests/gpu/test_gpu_transformers.py tests/gpu/test_gpu_softmax.py \
    tests/gpu/test_gpu_shared_tile.py tests/gpu/test_gpu_compile_ahead.py tests/gpu/test_gpu_drop_ins.py & pids+=($!)
  # Data checks, non-finite weights, threads/streams/memory/out-of-memory, DDP and FSDP2 (two GPUs).
  pytest_log gpu_contract 600 tests/gpu/test_gpu_validate.py tests/gpu/test_gpu_non_finite.py \
    tests/gpu/test_gpu_under_load.py tests/gpu/test_gpu_distributed.py & pids+=($!)
  pytest_log gpu_fuzz 900 tests/gpu/test_gpu_fuzz.py -s & pids+=($!)
  # The rest (the README command covers it too), without the sm_90 compile check: CI runs it,
  # and its compiles (724 since entry 102) on one core took minutes here beside the other groups.
  pytest_log rest 1200 tests --ignore=tests/gpu --deselect tests/test_kernels_compile.py::test_kernels_compile_for_hopper \
    ${parallel[@]+"${parallel[@]}"} & pids+=($!)
  sanitize >"$out/sanitize.log" 2>&1 & pids+=($!)
  # Each group reported as it ends, not in launch order: a call cut short (the device tool's
  # time limit) still prints every group that finished (session 49 lost the lines of five).
  # `wait -n -p` needs bash 5.1; an older bash waits in launch order.
  for _ in "${pids[@]}"; do
    if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501)); then
      wait -n -p pid; rc=$?  # the tier's jobs are the only ones this shell has
    else
      pid=${pids[$((done_count++))]}; wait "$pid"; rc=$?
    fi
    for i in "${!pids[@]}"; do [ "${pids[$i]}" = "$pid" ] && break; done
    echo "== ${names[$i]} exit $rc after $SECONDS s: $(grep -E '(passed|failed|error|summary)' "$out/${names[$i]}.log" | tail -1)"
    [ $rc = 0 ] || s=$rc
  done
  return $s
}

sanitize_backward() {  # racecheck and initcheck over the backward at both presets, every dtype
  compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 python3 scripts/sanitize_backward.py \
    && PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --error-exitcode 1 python3 scripts/sanitize_backward.py
}
# Each argument is one part: tests[:PATHS], sanitize, tune, bench, or mod:MODULE (python -m MODULE).
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tier bench)
for part in "${parts[@]}"; do
  case $part in
    tier) tier; s=$? ;;
    tests*) path=${part#tests}; path=${path#:}
            python3 -m pytest ${path:-tests} -q -rfE -p no:cacheprovider 2>&1 | tee "$out/gpu_tier.log"; s=${PIPESTATUS[0]} ;;
    sanitize) sanitize 2>&1 | tee "$out/sanitize.log"; s=${PIPESTATUS[0]} ;;
    sanitize_backward) sanitize_backward 2>&1 | tee "$out/sanitize_backward.log"; s=${PIPESTATUS[0]} ;;
    tune) python3 -m bench.tune 2>&1 | tee "$out/tune.log"; s=${PIPESTATUS[0]} ;;
    bench) python3 -m bench --out "$out/bench" 2>&1 | tee "$out/bench.log"; s=${PIPESTATUS[0]} ;;
    mod:*) python3 -m ${part#mod:} 2>&1 | tee -a "$out/extra.log"; s=${PIPESTATUS[0]} ;;
    *) echo "unknown part $part"; s=2 ;;
  esac
  echo "== $part exit $s"; [ "$s" = 0 ] || status=$s
done
exit $status
