# Session 28, call 1 (the branch after its fix): the first call with and without the backward compiled ahead, then the GPU tier.
export PYTHONPATH=. PYTHONUNBUFFERED=1
fc() { TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/first_call.py "$@" 2>&1 | grep -v Warn | tail -1; }
echo "== first calls, an empty Triton cache each (ABBA)"
fc 4 32 --at-launch; fc 4 32; fc 4 32; fc 4 32 --at-launch
fc 4 4 --encoder; fc 4 4 --encoder --at-launch
fc 4 32 --dtype bfloat16 --at-launch; fc 4 32 --dtype bfloat16
echo "== tier"
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier
