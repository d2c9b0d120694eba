#!/usr/bin/env bash
# Session 31, call 2: where the float32 forwards' warps stall, instruction by instruction (ncu's
# per-PC stall sampling, the SourceCounters section), at the rule's tiles: the decoder (16 x 2,
# 40 registers) and the encoder (2 x 2, one warp, 56 registers), `local` and uniform.
set -u
export PYTHONPATH=$PWD
NCU="ncu --profile-from-start off --cache-control none --clock-control none -k regex:msda --section SourceCounters --section WarpStateStats"
for preset in decoder encoder; do
  if [ $preset = decoder ]; then tile=16,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=40
  else tile=2,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56; fi
  for dist in local uniform; do
    $NCU -o $OUT/$preset-$dist python3 -m bench.tune --ncu --kernels fwd --presets $preset --dtypes float32 \
      --dists $dist --forward $tile > $OUT/$preset-$dist.log 2>&1 || tail -20 $OUT/$preset-$dist.log
    ncu --import $OUT/$preset-$dist.ncu-rep --page source --csv --print-source sass > $OUT/$preset-$dist-source.csv 2>&1
    ncu --import $OUT/$preset-$dist.ncu-rep --page details --csv > $OUT/$preset-$dist-details.csv 2>&1
    rm -f $OUT/$preset-$dist.ncu-rep
    echo "$preset $dist: $(wc -l < $OUT/$preset-$dist-source.csv) source lines"; head -c 600 $OUT/$preset-$dist-source.csv; echo
  done
done
