#!/usr/bin/env bash
# Session 50, a device call of the bench alone (run it after the tier, never beside it): the
# decoder preset in all three dtypes (half first: issue 13's half decoder cells), then the
# encoder in float32 (issue 12's `local` cell), then in half precision, both distributions,
# msda against deformops. results.json is written as cells finish, so a call cut short keeps
# what it finished; at most 8 files come back. To run (carry .whl):
#   LIMIT=585 bash bench/results/sweeps/session50-bench.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
limit=${LIMIT:-585}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
for run in "decoder float16,bfloat16,float32 uniform" "encoder float32 uniform local" \
           "encoder float16,bfloat16 uniform local"; do
  set -- $run
  left=$((limit - SECONDS - 5)); [ $left -gt 30 ] || break
  dir="$out/$1-${2%%,*}"
  PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m bench --preset "$1" --dtype "$2" --dist ${@:3} \
    --variants msda deformops --peers deformops --out "$dir" >/dev/null 2>>"$out/bench.err"
  rc=$?
  # a run cut short: its table from the cells it finished
  [ $rc = 0 ] || PYTHONPATH=$PWD python3 -m bench.report "$dir/results.json" >/dev/null 2>&1
  rm -f "$dir"/*.png
  echo "bench $run exit $rc after $SECONDS s"
done
tail -5 "$out/bench.err"
