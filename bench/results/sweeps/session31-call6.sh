#!/usr/bin/env bash
# Session 31, call 6: control for call 5, the thread a daemon again (the tree's ahead.py patched
# for this call only): does the new cache assertion fail without the fix?
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
grep -n "daemon=" msda/kernels/ahead.py
for i in 1 2; do
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_compile_ahead.py -k exits_cleanly 2>&1 | grep -E "passed|failed|assert|Error" | tail -6
done
