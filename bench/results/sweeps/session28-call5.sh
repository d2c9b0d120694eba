# Session 28, call 5: the eager launcher's key by Triton's integer classes. The new shared-tile
# test on the launcher before the fix (expected to fail), then after it, with the launcher's tests.
# session28-call5-direct_before.py was `git show 5215f76:msda/kernels/direct.py` (not kept: a copy).
export PYTHONPATH=. PYTHONUNBUFFERED=1
cp msda/kernels/direct.py /tmp/direct_after.py
cp bench/results/sweeps/session28-call5-direct_before.py msda/kernels/direct.py
echo "== before the fix"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_shared_tile.py -k one_query 2>&1 | grep -E "^E |passed|failed" | head -8
cp /tmp/direct_after.py msda/kernels/direct.py
echo "== after the fix"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_shared_tile.py tests/test_direct_launch.py 2>&1 | tail -2
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_numerics.py -k "eager_launches or misaligned" 2>&1 | tail -2
