#!/usr/bin/env bash
# Session 30, call 1: the `.cg` cache modifier on the value gathers (session30-call1-value_cache.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session30-call1-value_cache.py 2>&1 | tee $OUT/session30-call1.log
