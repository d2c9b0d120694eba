"""Session 45: the half-precision backward with a replica buffer at any density (entry 97: the
kernels pick each level's replicas; the lane placement adds into them; the fold's runs) against
HEAD's rules (no buffer at or under one sample a value row; the step loop wherever replicas
exist; one fold program walking every replica of its pixels), in turns, one process. Per row:
graph replay us of torch.ops.msda.backward (20 calls a graph), profiler us, grad_value's error.

    PYTHONPATH=. python3 bench/results/sweeps/session45-always_replicas.py
"""

from __future__ import annotations

import statistics

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import graph_device_time, profiler_device_time
from msda.kernels import backward, launch
from msda.testing import DETR_LEVELS, PRESETS, Shape, make_inputs, reference_with_grads, relative_error

RT_DETR_LEVELS = ((80, 80), (40, 40), (20, 20))
SHAPES = {  # (shape, dist)
    "decoder preset": (PRESETS["decoder"], "uniform"),
    "RT-DETR decoder, B=4": (Shape(4, 300, 8, 32, RT_DETR_LEVELS, 4), "local"),
    "DINO 4-scale (Q=900)": (Shape(4, 900, 8, 32, DETR_LEVELS, 4), "local"),
    "encoder preset": (PRESETS["encoder"], "uniform"),
    "fuzz's 1x1 levels (B=1, Q=93)": (Shape(1, 93, 9, 256, ((1, 1),) * 4 + ((31, 30),), 2), "uniform"),
}
NEW_ROWS, NEW_CONSTEXPRS = backward.replica_rows, launch._backward_constexprs
NEW_FOLD = (launch.FOLD_REPLICAS_A_PROGRAM, launch.FOLD_UNROLL)


def head_rows(accumulator, num_queries, num_values, num_levels, num_points, *, force=False):
    if not force and num_queries * num_levels * num_points <= num_values:
        return None
    return NEW_ROWS(accumulator, num_queries, num_values, num_levels, num_points, force=force)


def head_constexprs(*args):
    constexprs = dict(NEW_CONSTEXPRS(*args))
    if constexprs["REPLICAS"]:
        constexprs["LANE_PLACEMENT"] = False
    return constexprs


def use(variant):
    new = variant == "new"
    backward.replica_rows = NEW_ROWS if new else head_rows
    launch.replica_rows = NEW_ROWS if new else head_rows
    launch._backward_constexprs = NEW_CONSTEXPRS if new else head_constexprs
    launch.FOLD_REPLICAS_A_PROGRAM, launch.FOLD_UNROLL = NEW_FOLD if new else (2**30, 1)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, (shape, dist) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16):
            inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=1)
            args = inputs.args()
            grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
            times = {v: {"graph": [], "profiler": []} for v in ("head", "new")}
            for _ in range(3):
                for v in times:
                    use(v)
                    call = lambda: torch.ops.msda.backward(grad, *args)  # noqa: E731
                    times[v]["graph"].append(graph_device_time(call, 20, 5).median_us)
                    times[v]["profiler"].append(profiler_device_time(call, 10, 3).median_us)
            _, expected, _, _ = reference_with_grads(inputs, grad)
            errors = {}
            for v in times:
                use(v)
                errors[v] = relative_error(torch.ops.msda.backward(grad, *args)[0].double(), expected)
            use("new")
            cells = "  ".join(
                f"{v}: graph {statistics.median(times[v]['graph']):7.1f} "
                f"prof {statistics.median(times[v]['profiler']):7.1f} err {errors[v]:.2e}"
                for v in times
            )
            print(f"{name:30} {str(dtype)[6:]:9} {cells}", flush=True)
            del expected
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
