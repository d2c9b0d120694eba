#!/usr/bin/env bash
# Session 33, call 2: does an eager step wait for the GPU; its CUDA calls (session33-call2-step_probe.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 bench/results/sweeps/session33-call2-step_probe.py 2>&1 | grep -v Warning | tee $OUT/session33-call2.log
