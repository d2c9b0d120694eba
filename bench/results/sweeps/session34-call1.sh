#!/usr/bin/env bash
# Session 34, call 1: one-group tiles for the float32 encoder forward (bench.tune, two rounds,
# the rule first and last), then the whole GPU tier at 7726111's code.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
rule=2,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56
for round in 1 2; do
  python3 -m bench.tune --presets encoder --dtypes float32 --dists uniform local --kernels fwd --forward $rule \
    4,1,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56 \
    4,1,0,prefetch=1,lane_placement=1,lane_unroll=4,max_registers=56 \
    4,1,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56,params_ahead=1 \
    4,1,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=64 \
    8,1,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56 \
    1,4,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56 $rule 2>&1 | grep -v -i warn
done | tee $OUT/session34-call1-tune.log
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier 2>&1 | tail -12
