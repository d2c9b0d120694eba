"""Session 45: the half-precision backward with replicas (the encoders), its step loop (as at
HEAD: the lane placement added only into grad_value) against the lane placement adding into
the replicas too (branch lane-replicas: `_replica_shifts`, `_turn_accumulator`), in turns, one
process. Ran the branch's msda, copied beside this script for the call (not kept: 04e05f6 has
those kernels, with the per-level offsets computed inline):

    PYTHONPATH=bench/results/sweeps/session45-lane:. python3 bench/results/sweeps/session45-lane_replicas.py

Per row: graph replay us of torch.ops.msda.backward (20 calls a graph), profiler us, grad_value's
relative error against float64 for each.
"""

from __future__ import annotations

import statistics

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import graph_device_time, profiler_device_time
from msda.kernels import launch
from msda.testing import DETR_LEVELS, PRESETS, Shape, make_inputs, reference_with_grads, relative_error

assert "session45-lane" in msda.__file__, msda.__file__
SHAPES = {  # (shape, dist)
    "encoder preset": (PRESETS["encoder"], "uniform"),
    "encoder preset, local": (PRESETS["encoder"], "local"),
    "Mask2Former (B=8, 512x512), local": (
        Shape(batch=8, queries=5376, heads=8, head_dim=32, levels=((64, 64), (32, 32), (16, 16)), points=4), "local"
    ),
    "Q=1500 (1.08 a row), B=4": (
        Shape(batch=4, queries=1500, heads=8, head_dim=32, levels=DETR_LEVELS, points=4), "uniform"
    ),
}
LANE = launch._backward_constexprs


def steps(*args):
    constexprs = dict(LANE(*args))
    if constexprs["REPLICAS"]:
        constexprs["LANE_PLACEMENT"] = False
    return constexprs


VARIANTS = {"step loop (HEAD)": steps, "lane placement": LANE}


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, (shape, dist) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16):
            inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=1)
            args = inputs.args()
            grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
            times = {v: {"graph": [], "profiler": []} for v in VARIANTS}
            for _ in range(3):
                for v, rule in VARIANTS.items():
                    launch._backward_constexprs = rule
                    call = lambda: torch.ops.msda.backward(grad, *args)  # noqa: E731
                    times[v]["graph"].append(graph_device_time(call, 20, 5).median_us)
                    times[v]["profiler"].append(profiler_device_time(call, 10, 3).median_us)
            _, expected, expected_loc, _ = reference_with_grads(inputs, grad)
            errors = {}
            for v, rule in VARIANTS.items():
                launch._backward_constexprs = rule
                grad_value, grad_loc, _ = torch.ops.msda.backward(grad, *args)
                errors[v] = (relative_error(grad_value.double(), expected), relative_error(grad_loc, expected_loc))
            launch._backward_constexprs = LANE
            cells = "  ".join(
                f"{v}: graph {statistics.median(times[v]['graph']):7.1f} "
                f"prof {statistics.median(times[v]['profiler']):7.1f} err {errors[v][0]:.2e} / {errors[v][1]:.2e}"
                for v in VARIANTS
            )
            print(f"{name:36} {str(dtype)[6:]:9} {cells}", flush=True)
            del expected, expected_loc
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
