"""Session 45: the fold of the half-precision replicas, one program walking every replica of its
pixels one load at a time (FOLD_REPLICAS_A_PROGRAM = 10**9, FOLD_UNROLL = 1: as before entry 97)
against runs of at least 16 replicas a program, 4 loads in flight (HEAD), in turns, one process.
Per row: graph replay us of torch.ops.msda.backward (20 calls a graph), profiler us, and
grad_value's relative error against float64 for each. Run on the device:

    PYTHONPATH=. python3 bench/results/sweeps/session45-fold_runs.py
"""

from __future__ import annotations

import statistics

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import graph_device_time, profiler_device_time
from msda.kernels import launch
from msda.testing import DETR_LEVELS, PRESETS, Shape, make_inputs, reference_with_grads, relative_error

SHAPES = {  # (shape, dist)
    "encoder preset": (PRESETS["encoder"], "uniform"),
    "encoder preset, local": (PRESETS["encoder"], "local"),
    "Mask2Former (B=8, 512x512)": (
        Shape(batch=8, queries=5376, heads=8, head_dim=32, levels=((64, 64), (32, 32), (16, 16)), points=4), "local"
    ),
    "Q=1500 + a 1x1 level (1.35 a row)": (
        Shape(batch=2, queries=1500, heads=8, head_dim=32, levels=DETR_LEVELS + ((1, 1),), points=4), "uniform"
    ),
    "encoder at 320x320": (
        Shape(batch=2, queries=2125, heads=8, head_dim=32, levels=((40, 40), (20, 20), (10, 10), (5, 5)), points=4),
        "local",
    ),
}
FOLDS = {"one run, 1 load": (10**9, 1), "runs of 16, 4 loads": (16, 4)}
HEAD = (launch.FOLD_REPLICAS_A_PROGRAM, launch.FOLD_UNROLL)


def use(fold):
    launch.FOLD_REPLICAS_A_PROGRAM, launch.FOLD_UNROLL = fold


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, (shape, dist) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16):
            inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=1)
            args = inputs.args()
            grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
            times = {f: {"graph": [], "profiler": []} for f in FOLDS}
            for _ in range(3):
                for f, fold in FOLDS.items():
                    use(fold)
                    call = lambda: torch.ops.msda.backward(grad, *args)  # noqa: E731
                    times[f]["graph"].append(graph_device_time(call, 20, 5).median_us)
                    times[f]["profiler"].append(profiler_device_time(call, 10, 3).median_us)
            _, expected, _, _ = reference_with_grads(inputs, grad)
            errors = {}
            for f, fold in FOLDS.items():
                use(fold)
                errors[f] = relative_error(torch.ops.msda.backward(grad, *args)[0].double(), expected)
            use(HEAD)
            cells = "  ".join(
                f"{f}: graph {statistics.median(times[f]['graph']):7.1f} "
                f"prof {statistics.median(times[f]['profiler']):7.1f} err {errors[f]:.2e}"
                for f in FOLDS
            )
            print(f"{name:36} {str(dtype)[6:]:9} {cells}", flush=True)
            del expected
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
