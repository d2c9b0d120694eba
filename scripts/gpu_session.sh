#!/usr/bin/env bash
# One device call: the GPU test tier, then the benchmark (or the launch-config sweep).
#   scripts/gpu_session.sh [tests[:PATHS]|sanitize|tune|bench|mod:MODULE ...]   (default: tests bench)
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
# Each argument is one part: tests[:PATHS], sanitize, tune, bench, or mod:MODULE (python -m MODULE).
for part in "${@:-tests bench}"; do
  case $part in
    tests*) path=${part#tests}; path=${path#:}
            python3 -m pytest ${path:-tests} -q -rfE -p no:cacheprovider 2>&1 | tee "$out/gpu_tier.log"; s=${PIPESTATUS[0]} ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize.py 2>&1 | tee "$out/sanitize.log"; s=${PIPESTATUS[0]} ;;
    tune) python3 -m bench.tune 2>&1 | tee "$out/tune.log"; s=${PIPESTATUS[0]} ;;
    bench) python3 -m bench --out "$out/bench" 2>&1 | tee "$out/bench.log"; s=${PIPESTATUS[0]} ;;
    mod:*) python3 -m ${part#mod:} 2>&1 | tee -a "$out/extra.log"; s=${PIPESTATUS[0]} ;;
    *) echo "unknown part $part"; s=2 ;;
  esac
  echo "== $part exit $s"; [ "$s" = 0 ] || status=$s
done
exit $status
