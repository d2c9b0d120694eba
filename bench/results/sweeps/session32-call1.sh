#!/usr/bin/env bash
# Session 32, calls 1-2: persistent encoder forward programs (session32-call1-persistent.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session32-call1-persistent.py 2>&1 | grep -v Warning | tee $OUT/session32-call2.log
