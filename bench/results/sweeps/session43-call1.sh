#!/usr/bin/env bash
# Session 43, call 1: the other models' presets (bench/variants.OTHER_MODELS, added in session 42
# and smoke-checked only on CPU) under the bench protocol on the GPU, msda against deformops 3.0.1:
# uniform for all five, then `local` for the two encoder-like ones (Q == S).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 380 python3 -m bench --preset dino rtdetr mask2former bevformer-tsa bevformer-sca --dist uniform \
  --variants msda deformops --peers deformops --out "$OUT/bench-uniform" >"$OUT/bench-uniform.log" 2>&1
echo "bench uniform exit $? after $((SECONDS - t0)) s"
t0=$SECONDS
timeout $((570 - SECONDS)) python3 -m bench --preset mask2former bevformer-tsa --dist local \
  --variants msda deformops --peers deformops --out "$OUT/bench-local" >"$OUT/bench-local.log" 2>&1
echo "bench local exit $? after $((SECONDS - t0)) s"
