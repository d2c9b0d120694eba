# Session 28, call 2: the direct C launch A/B, its two new tests, then the tier and bench.calls.
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 bench/results/sweeps/session28-call2-direct_launch.py 2>&1 | grep -v Warn
echo "== the tier"
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier
echo "== bench.calls"
python3 -m bench.calls 2>&1 | tail -16
