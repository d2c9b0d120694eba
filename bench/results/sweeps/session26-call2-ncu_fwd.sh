#!/usr/bin/env bash
# ncu of the float32 forward at the decoder (the rule's tile, and at 48 registers) and the encoder
# (the rule's one-warp tile), caches as the previous replay pass left them (steady state).
set -u
export PYTHONPATH=$PWD
M=gpu__time_duration.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_hit_rate.pct,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shfl.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,lts__t_sectors.sum,lts__d_sectors.sum,sm__cycles_active.avg
NCU="ncu --profile-from-start off --cache-control none --clock-control none -k regex:msda --csv --page raw --section WarpStateStats --section SpeedOfLight --metrics $M"
$NCU python3 -m bench.tune --ncu --kernels fwd --presets decoder --dtypes float32 --dists uniform local \
  --forward 16,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=40 16,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=48 \
  > $OUT/ncu-decoder.csv 2> $OUT/ncu-decoder.err
$NCU python3 -m bench.tune --ncu --kernels fwd --presets encoder --dtypes float32 --dists local uniform \
  --forward 2,2,0,prefetch=1,lane_placement=1,lane_unroll=2,max_registers=56 \
  > $OUT/ncu-encoder.csv 2> $OUT/ncu-encoder.err
export M
python3 - <<'PY'
import csv, os
out = os.environ["OUT"]
for name in ("decoder", "encoder"):
    rows = list(csv.reader(open(f"{out}/ncu-{name}.csv")))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        print(name, "no rows"); print(open(f"{out}/ncu-{name}.err").read()[-2000:]); continue
    head, units, data = rows[start], rows[start + 1], rows[start + 2:]
    for col, h in enumerate(head):
        if h in os.environ["M"].split(",") or h == "Kernel Name":
            print(f"{name} {h:70s} " + " | ".join(r[col][:14] for r in data))
PY
