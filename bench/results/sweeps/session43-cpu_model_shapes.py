"""Session 43: session 42's sweep (msda's CPU path against the grid_sample formulation at other
models' shapes, batch 1, float32, uniform locations, eager, 1 and 2 threads, bench.cpu's
machinery: settled glibc, variants in turns, medians in ms), with a filter on the shapes' names
and repeats, for the noisy small cells. A scratch sweep, not `python -m bench.cpu`:

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python3 bench/results/sweeps/session43-cpu_model_shapes.py [NAME_PART [REPEATS]]
"""

from __future__ import annotations

import statistics
import sys

import torch

from bench.cpu import call_for, grid_fn, msda_fn, round_robin, settle_allocator
from msda.testing import DETR_LEVELS, Shape, make_inputs

SHAPES = {
    "RT-DETR decoder 640x640": Shape(1, 300, 8, 32, ((80, 80), (40, 40), (20, 20)), 4),
    "DINO decoder Q=900": Shape(1, 900, 8, 32, DETR_LEVELS, 4),
    "Mask2Former pixel decoder 512x512": Shape(1, 5376, 8, 32, ((16, 16), (32, 32), (64, 64)), 4),
    "BEVFormer-tiny temporal self-attn 50x50": Shape(2, 2500, 8, 32, ((50, 50),), 4),
    "decoder, 4 heads of 64": Shape(1, 300, 4, 64, DETR_LEVELS, 4),
}


def main() -> int:
    settle_allocator()
    print(f"torch {torch.__version__}; ms, median of rounds in turns; speedup = grid_sample / msda")
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for threads in [t for t in (1, 2) for _ in range(repeats)]:
        torch.set_num_threads(threads)
        for name, shape in SHAPES.items():
            if part not in name:
                continue
            inputs = make_inputs(shape, torch.float32, "cpu", seed=3)
            args = inputs.args()
            grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim)
            for pass_ in ("forward", "forward+backward"):
                calls = {"msda": call_for(msda_fn, args, pass_, grad), "grid_sample": call_for(grid_fn, args, pass_, grad)}
                with torch.no_grad() if pass_ == "forward" else torch.enable_grad():
                    samples, last = round_robin(calls, 5, 200, 1.5, print)
                m, g = (1e3 * statistics.median(samples[v]) for v in ("msda", "grid_sample"))
                diff = max((a - b).abs().max().item() for a, b in zip(last["msda"], last["grid_sample"]))
                print(f"{threads} thr  {name:40} {pass_:17} msda {m:8.2f}  grid_sample {g:8.2f}  {g / m:5.2f}x"
                      f"  (max diff {diff:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
