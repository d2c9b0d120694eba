#!/usr/bin/env bash
# Session 49, first device call: the decoder preset's bench in all three dtypes (half first:
# issue 13's half decoder cells), msda against deformops, then the whole GPU tier (fuzz at 50
# examples a dtype) with the time left. The bench runs alone, never beside the tier. Not run in
# session 49 (no H200 came; entry 101); to run
# (carry .whl):   LIMIT=585 bash bench/results/sweeps/session49-call.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
limit=${LIMIT:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
PYTHONPATH=$PWD:/tmp/site timeout 170 python3 -m bench --preset decoder --dtype float16,bfloat16,float32 \
  --variants msda deformops --peers deformops --out /tmp/bench >/dev/null 2>/tmp/bench.err
rc=$?
tail -3 /tmp/bench.err
# 8 files come back at most and the tier's logs take 7: the results go to the output.
[ $rc = 0 ] || PYTHONPATH=$PWD python3 -m bench.report /tmp/bench/results.json >/dev/null 2>&1  # a run cut short
head -c 6000 /tmp/bench/results.md
echo "bench decoder exit $rc after $SECONDS s"
MSDA_GPU_FUZZ_EXAMPLES=50 timeout $((limit - SECONDS - 5)) bash scripts/gpu_session.sh tier
echo "tier exit $? after $SECONDS s"
