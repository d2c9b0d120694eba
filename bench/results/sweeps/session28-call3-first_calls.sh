# Session 28, call 3: the first forward + backward at L x K up to 128 since the backward's compile
# moved into the forward's thread (entry 63), an empty Triton cache a process (issue 12 item 3).
export PYTHONPATH=. PYTHONUNBUFFERED=1
fc() { TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/first_call.py "$@" 2>&1 | grep -v Warn | tail -1; }
for lk in "4 32" "8 16" "2 64" "1 128" "16 8"; do fc $lk; done
for dt in float16 bfloat16; do fc 4 32 --dtype $dt; fc 8 16 --dtype $dt; done
fc 4 4 --encoder; fc 4 8 --encoder --dtype bfloat16; fc 4 32
