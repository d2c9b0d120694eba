#!/usr/bin/env bash
# Issue 14's model-level rows on the H200, never run there yet: bench.detr (a transformers Deformable
# DETR, ResNet-50, random weights, 800x1333, batch 2, stock against patched). Eager rows first
# (about a minute), then the compiled ones (8 compiles: may need a call of their own).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -m bench.detr --no-compile --out "$OUT/detr-eager.md" 2>&1 | grep -v -i warn | tail -14
timeout 480 python3 -m bench.detr --precisions float32 --out "$OUT/detr-compiled-float32.md" 2>&1 | grep -v -i warn | tail -14
