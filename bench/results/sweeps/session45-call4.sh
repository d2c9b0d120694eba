#!/usr/bin/env bash
# Session 45, call 4 (the last ~290 s of device time): the GPU tier's graph group on entry 97's
# tree (replicas at any density, so the half-precision decoders now capture and export a replica
# buffer and a fold): CUDA graphs and export; torch.compile ran in call 3.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest tests/gpu/test_gpu_cuda_graphs.py tests/gpu/test_gpu_export.py -n 4 -q -rfEs \
  -p no:cacheprovider >"$OUT/graphs.log" 2>&1
echo "== graphs exit $?: $(grep -E 'passed|failed|error' "$OUT/graphs.log" | tail -1)"
