#!/usr/bin/env bash
# Session 31, call 5: the compile-ahead tests three times over, the thread no longer a daemon
# (call 4's tier: a process ending while it compiled aborted, SIGABRT).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
for i in 1 2 3; do
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_compile_ahead.py 2>&1 | tail -3
done
