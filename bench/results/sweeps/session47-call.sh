#!/usr/bin/env bash
# Session 47, one call for everything (the device lent no machine for 75 minutes, so one start
# is all the session's device time allows): the whole GPU tier on main (fuzz at 50 examples a
# dtype), then, in the time left, the branch fold-in-kernel's four-turn sweep of the half
# decoders' backward (tree exported to .scratch/fold and carried), then the decoder preset's
# bench on main. Never beside the tier: one after the other. As run (carry .whl and .scratch/fold):
#   LIMIT=500 bash bench/results/sweeps/session47-call.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
# LIMIT: the call's seconds (less than 588 where less device time is left). The tier's logs go
# straight to $OUT (7 files), so that they come back even if the call is stopped.
main=$PWD fold=$PWD/.scratch/fold limit=${LIMIT:-588}
MSDA_GPU_FUZZ_EXAMPLES=50 timeout $((limit - 10)) bash scripts/gpu_session.sh tier
echo "tier exit $? after $SECONDS s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
t0=$SECONDS
(cd "$fold" && PYTHONPATH=$fold:/tmp/site timeout $((limit - 3 - SECONDS)) python3 bench/results/sweeps/session46-decoder_fills.py) \
  >"$OUT/decoder_fills.log" 2>&1
echo "decoder_fills (branch) exit $? after $((SECONDS - t0)) s"
left=$((limit - SECONDS))
if [ $left -gt 60 ]; then
  PYTHONPATH=$main:/tmp/site timeout $left python3 -m bench --preset decoder --dtype float16,bfloat16 \
    --variants msda deformops --peers deformops --out /tmp/bench-main >/dev/null 2>/tmp/bench-main.err
  tail -3 /tmp/bench-main.err; head -c 6000 /tmp/bench-main/results.md  # 8 files come back at most: the tail
  echo "bench decoder (main) exit $? after $SECONDS s"
fi
