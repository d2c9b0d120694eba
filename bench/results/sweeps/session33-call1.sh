#!/usr/bin/env bash
# Session 33, call 1: the carveout of msda's kernels (session33-call1-carveout.py), then ncu's
# view of the shared-memory configuration the driver picked for the float32 encoder forward.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session33-call1-carveout.py 2>&1 | grep -v Warning | tee $OUT/session33-call1.log
ncu --kernel-name regex:msda_forward --launch-skip 1 --launch-count 3 \
  --metrics launch__shared_mem_config_size,launch__occupancy_limit_shared_mem,l1tex__t_sector_hit_rate.pct,gpu__time_duration.sum \
  python3 bench/results/sweeps/session33-call1-carveout.py --ncu 2>&1 | grep -v Warning | tail -40 | tee -a $OUT/session33-call1.log
