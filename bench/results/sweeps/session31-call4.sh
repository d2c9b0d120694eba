#!/usr/bin/env bash
# Session 31, call 4: the whole GPU tier with the half-precision decoders' parameters loaded a
# round ahead (NOTES entry 69), then the README's bench of the twelve cells.
set -uo pipefail
export PYTHONUNBUFFERED=1
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier; echo "tier exit $?"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic --peers \
  --out $OUT/bench > $OUT/bench.log 2>&1; echo "bench exit $?"
tail -45 $OUT/bench.log
