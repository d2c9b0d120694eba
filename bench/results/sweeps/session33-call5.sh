#!/usr/bin/env bash
# Session 33, call 5: the prepared eager forward, A/B in one process; then the whole GPU tier at d1cd794.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 bench/results/sweeps/session33-call5-prepared_ab.py 2>&1 | grep -v -i warn | tee $OUT/session33-call5.log
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier 2>&1 | tail -12
