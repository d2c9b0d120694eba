#!/usr/bin/env bash
# Query passes A/B at the float32 decoder (graph us, bench.tune), twice; the encoder rule with 2 passes.
export PYTHONPATH=$PWD
P="prefetch=1,lane_placement=1"
T0="16,2,0,$P,lane_unroll=2,max_registers=40"
T1="8,2,0,$P,lane_unroll=2,max_registers=64,query_passes=2"
T2="8,2,0,$P,lane_unroll=4,max_registers=80,query_passes=2"
T3="8,2,0,$P,lane_unroll=4,max_registers=96,query_passes=2"
T4="4,2,0,$P,lane_unroll=4,max_registers=96,query_passes=4"
T5="4,2,0,$P,lane_unroll=8,max_registers=128,query_passes=4"
T6="16,2,0,$P,lane_unroll=4,max_registers=80,query_passes=2"
for round in 1 2; do
  python3 -m bench.tune --kernels fwd --presets decoder --dtypes float32 --dists uniform local --forward $T0 $T1 $T2 $T3 $T4 $T5 $T6 $T0 2>&1 | grep -v "^deformops\|Warning\|warn"
done
E0="2,2,0,$P,lane_unroll=2,max_registers=56"
E1="2,2,0,$P,lane_unroll=2,max_registers=56,query_passes=2"
E2="2,2,0,$P,lane_unroll=2,max_registers=64,query_passes=4"
python3 -m bench.tune --kernels fwd --presets encoder --dtypes float32 --dists local uniform --forward $E0 $E1 $E2 $E0 2>&1 | grep -v "^deformops\|Warning\|warn"
