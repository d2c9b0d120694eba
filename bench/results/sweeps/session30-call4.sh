#!/usr/bin/env bash
# Session 30, call 4: the README's bench of the twelve cells at the tree of NOTES entry 67 (kernels as since
# session 27), then python -m bench.calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic --peers \
  --out $OUT/bench > $OUT/bench.log 2>&1; echo "bench exit $?"
tail -60 $OUT/bench.log
python3 -m bench.calls 2>&1 | grep -v Warning | tail -22
