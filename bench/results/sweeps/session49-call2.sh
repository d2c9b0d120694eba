#!/usr/bin/env bash
# Session 49, second device call (on the machine the first left warm): the encoder preset's
# bench, float32 first (issue 12's `local` cell, issue 13's float32 encoder cells), then half
# precision, both distributions, msda against deformops; then `python -m bench.calls`.
# results.json is written during the run, so a call cut short keeps the cells it finished.
# Not run in session 49 (no H200 came; entry 101). To run:
#   LIMIT=... bash bench/results/sweeps/session49-call2.sh   (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
limit=${LIMIT:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
for dtype in float32 float16,bfloat16; do
  left=$((limit - SECONDS - 5)); [ $left -gt 30 ] || break
  PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m bench --preset encoder --dtype $dtype --dist uniform local \
    --variants msda deformops --peers deformops --out "$OUT/encoder-${dtype%%,*}" >/dev/null 2>>"$OUT/bench.err"
  echo "bench encoder $dtype exit $? after $SECONDS s"
done
left=$((limit - SECONDS - 5))
[ $left -gt 30 ] && PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m bench.calls >"$OUT/calls.log" 2>>"$OUT/bench.err"
echo "bench.calls exit $? after $SECONDS s"
