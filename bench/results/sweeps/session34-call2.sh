#!/usr/bin/env bash
# Session 34, call 2: the prepared eager backward, A/B in one process; the GPU tests it touches;
# the README's bench; bench.calls.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session34-call2-prepared_backward_ab.py 2>&1 | grep -v -i warn | tee $OUT/session34-call2-ab.log
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_numerics.py -k "prepared or misaligned or hook or c_launcher" \
  tests/test_direct_launch.py 2>&1 | tail -4 | tee $OUT/session34-call2-tests.log
python3 -m bench --preset decoder encoder --dist uniform local --variants msda msda-deterministic --peers --out /tmp/bench \
  > $OUT/session34-call2-bench.log 2>&1; tail -22 $OUT/session34-call2-bench.log; cp /tmp/bench/results.md $OUT/session34-call2-bench-results.md
python3 -m bench.calls --rounds 5 2>&1 | grep -v -i warn | tee $OUT/session34-call2-calls.log
