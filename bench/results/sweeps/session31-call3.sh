#!/usr/bin/env bash
# Session 31, call 3: parameters a round ahead, programs of several passes (session31-call3-params_ahead.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session31-call3-params_ahead.py 2>&1 | grep -v Warning | tee $OUT/session31-call3.log
