#!/usr/bin/env bash
# Session 32, call 5: the eager path's allocations, before (.scratch/old, a copy of msda at 6b2280a) and after.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
script=bench/results/sweeps/session32-call5-allocations.py
ALLOCATIONS=1 python3 $script 2>&1 | grep -v Warn
for round in 1 2 3; do
  echo "== round $round, before"; MSDA_ROOT=.scratch/old python3 $script 2>&1 | grep -v Warn
  echo "== round $round, after"; python3 $script 2>&1 | grep -v Warn
done
