#!/usr/bin/env bash
# Session 48, first device call: the whole GPU tier on the branch fold-in-kernel (fuzz at 50
# examples a dtype), then the decoder preset's bench in all three dtypes, msda against
# deformops. One after the other, never beside the tier. As run (carry .whl):
#   LIMIT=580 bash bench/results/sweeps/session48-call.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
limit=${LIMIT:-588}
git log -1 --format='tree at %h %s' 2>/dev/null  # the device's own .git, not the tree sent (79cec73's)
MSDA_GPU_FUZZ_EXAMPLES=50 timeout $((limit - 130)) bash scripts/gpu_session.sh tier
echo "tier exit $? after $SECONDS s"
left=$((limit - SECONDS - 5))
if [ $left -gt 60 ]; then
  PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m bench --preset decoder --dtype float32,float16,bfloat16 \
    --variants msda deformops --peers deformops --out /tmp/bench >/dev/null 2>/tmp/bench.err
  rc=$?
  tail -3 /tmp/bench.err; head -c 7000 /tmp/bench/results.md  # 8 files come back at most: the tier's take 7
  echo "bench decoder exit $rc after $SECONDS s"
fi
