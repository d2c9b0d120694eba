#!/usr/bin/env bash
# Session 31, call 7: the whole GPU tier at 753a671 (the parameters ahead and the non-daemon compile-ahead thread).
set -uo pipefail
MSDA_GPU_FUZZ_EXAMPLES=50 bash scripts/gpu_session.sh tier; echo "tier exit $?"
