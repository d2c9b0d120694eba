#!/usr/bin/env bash
# Session 29, call 2: the compile-ahead file (its new exit tests among them), the launcher's tests,
# the shared tile's and the eager numerics' eager routes; then python -m bench.calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_gpu_compile_ahead.py tests/test_direct_launch.py \
  tests/gpu/test_gpu_shared_tile.py "tests/gpu/test_gpu_numerics.py" -k "ahead or exit or direct or eager or shared or launch" \
  --durations=8 2>&1 | tail -25
python3 -m bench.calls 2>&1 | tail -20
