#!/usr/bin/env bash
# One device call: the GPU test tier, then the benchmark (or the launch-config sweep).
#   scripts/gpu_session.sh [tier|tests[:PATHS]|sanitize|tune|bench|mod:MODULE ...]   (default: tier bench)
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

sanitize() {  # memcheck over the Triton kernels' edge shapes; nonzero exit on any error
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize.py
}

tier() {
  local pids=() names=(gpu_bad_input gpu_graphs gpu_numerics rest sanitize) i s=0
  pytest_log gpu_bad_input 300 tests/gpu/test_gpu_bad_input.py & pids+=($!)
  pytest_log gpu_graphs 300 tests/gpu/test_gpu_compile.py tests/gpu/test_gpu_cuda_graphs.py tests/gpu/test_gpu_export.py & pids+=($!)
  pytest_log gpu_numerics 300 tests/gpu/test_gpu_numerics.py tests/gpu/test_gpu_opcheck.py tests/gpu/test_gpu_streams.py \
    tests/gpu/test_gpu_two_devices.py tests/gpu/test_gpu_transformers.py tests/gpu/test_gpu_softmax.py & pids+=($!)
  # The rest (the README command covers it too). Its compile check builds 208 kernels on the CPU
  # (half of them the softmax forms): with half as many it took past 300 s while the other groups
  # compiled beside it, hence 1200 s.
  pytest_log rest 1200 tests --ignore=tests/gpu ${parallel[@]+"${parallel[@]}"} & pids+=($!)
  sanitize >"$out/sanitize.log" 2>&1 & pids+=($!)
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; local rc=$?
    echo "== ${names[$i]} exit $rc: $(grep -E '(passed|failed|error|summary)' "$out/${names[$i]}.log" | tail -1)"
    [ $rc = 0 ] || s=$rc
  done
  return $s
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
    tune) python3 -m bench.tune 2>&1 | tee "$out/tune.log"; s=${PIPESTATUS[0]} ;;
    bench) python3 -m bench --out "$out/bench" 2>&1 | tee "$out/bench.log"; s=${PIPESTATUS[0]} ;;
    mod:*) python3 -m ${part#mod:} 2>&1 | tee -a "$out/extra.log"; s=${PIPESTATUS[0]} ;;
    *) echo "unknown part $part"; s=2 ;;
  esac
  echo "== $part exit $s"; [ "$s" = 0 ] || status=$s
done
exit $status
