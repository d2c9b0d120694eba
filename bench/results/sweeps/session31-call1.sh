#!/usr/bin/env bash
# Session 31, call 1: L1 prefetch of later turns' rows in the forward (session31-call1-row_prefetch.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session31-call1-row_prefetch.py 2>&1 | grep -v Warning | tee $OUT/session31-call1.log
