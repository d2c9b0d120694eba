#!/usr/bin/env bash
# Session 48, second device call (on the machine the first left warm): the
# encoder preset's bench, float32 first (issue 12's `local` cell), then half precision, both
# distributions, msda against deformops. results.json is written during the run, so a call cut
# short still returns the cells it finished (python -m bench.report renders them). As run:
#   LIMIT=... bash bench/results/sweeps/session48-call2.sh   (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
limit=${LIMIT:-588}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log -1 --format='tree at %h %s' 2>/dev/null  # the device's own .git, not the tree sent
for dtype in float32 float16,bfloat16; do
  left=$((limit - SECONDS - 5)); [ $left -gt 30 ] || break
  PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m bench --preset encoder --dtype $dtype --dist uniform local \
    --variants msda deformops --peers deformops --out "$OUT/encoder-${dtype%%,*}" >/dev/null 2>"$OUT/encoder-${dtype%%,*}.err"
  echo "bench encoder $dtype exit $? after $SECONDS s"
done
# Calls 3-5 of session 48, on the same warm machine, as typed (carry .whl for 3 and 5):
#   3: pip install .whl as above; PYTHONPATH=$PWD:/tmp/site: timeout 200 python3 -m bench.calls >$OUT/calls.log;
#      python3 -m bench --preset dino rtdetr --dtype float16,bfloat16 --variants msda deformops --peers deformops --out $OUT/models
#   4: timeout 330 bash scripts/gpu_session.sh sanitize_backward
#   5: python3 -m bench --preset decoder --dist local --dtype float32,float16,bfloat16 --variants msda deformops --peers deformops --out $OUT/decoder-local
