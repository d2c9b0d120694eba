#!/usr/bin/env bash
# Session 45, call 2: the DINO and RT-DETR decoder presets under the bench protocol after bdc4455
# (half-precision replicas only past one sample a value row), msda against deformops 3.0.1,
# uniform locations, three dtypes; then the eager per-call rows (bench.calls), whether an eager
# step waits for the device (session45-host_or_device.py), the fold A/B (session45-fold_runs.py) and
# the lane placement into replicas (session45-lane_replicas.py, the branch lane-replicas copied beside it).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true
t0=$SECONDS
timeout 240 python3 -m bench --preset dino rtdetr --dist uniform \
  --variants msda deformops --peers deformops --out "$OUT/bench-uniform" >"$OUT/bench-uniform.log" 2>&1
echo "bench uniform exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
timeout 120 python3 -m bench.calls --rounds 3 >"$OUT/calls.log" 2>&1
echo "bench.calls exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
timeout 90 python3 bench/results/sweeps/session45-host_or_device.py >"$OUT/host_or_device.log" 2>&1
echo "host_or_device exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
timeout 150 python3 bench/results/sweeps/session45-fold_runs.py >"$OUT/fold_runs.log" 2>&1
echo "fold_runs exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
PYTHONPATH=bench/results/sweeps/session45-lane:$PYTHONPATH timeout $((595 - SECONDS)) \
  python3 bench/results/sweeps/session45-lane_replicas.py >"$OUT/lane_replicas.log" 2>&1
echo "lane_replicas exit $? after $((SECONDS - t0)) s"
