"""Session 44: the half-precision backward's replicas at shapes with 0.25-1 samples a value row
(RT-DETR, DINO): REPLICAS_MIN_SAMPLES_PER_ROW at 0.25 (HEAD) against 1.0, in turns, one process.
Per row: graph replay us of torch.ops.msda.backward (20 calls a graph, fresh buffers), profiler
us, the eager launch's end-to-end us, and grad_value's relative error against float64 at 1.0.
Run on the device:

    PYTHONPATH=. python3 bench/results/sweeps/session44-replicas_threshold.py [SHAPE NAME ...]
"""

from __future__ import annotations

import statistics
import sys

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import end_to_end_time, graph_device_time, profiler_device_time
from msda import eager
from msda.kernels import backward
from msda.testing import DETR_LEVELS, Shape, make_inputs, reference_with_grads, relative_error

RT_DETR_LEVELS = ((80, 80), (40, 40), (20, 20))
SHAPES = {
    "RT-DETR decoder, B=4": Shape(batch=4, queries=300, heads=8, head_dim=32, levels=RT_DETR_LEVELS, points=4),
    "RT-DETR decoder, B=1": Shape(batch=1, queries=300, heads=8, head_dim=32, levels=RT_DETR_LEVELS, points=4),
    "DINO 4-scale (Q=900)": Shape(batch=4, queries=900, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    "DINO 5-scale (Q=900)": Shape(
        batch=4, queries=900, heads=8, head_dim=32, levels=DETR_LEVELS + ((7, 11),), points=4
    ),
    "DINO + a 1x1 level": Shape(batch=4, queries=900, heads=8, head_dim=32, levels=DETR_LEVELS + ((1, 1),), points=4),
}
THRESHOLDS = (0.25, 1.0)
HEAD = backward.REPLICAS_MIN_SAMPLES_PER_ROW


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    names = sys.argv[1:] or list(SHAPES)  # a subset by name, e.g. "DINO 5-scale (Q=900)"
    for name in names:
        shape = SHAPES[name]
        S, Q, L, K = shape.num_values, shape.queries, len(shape.levels), shape.points
        for dtype in (torch.float16, torch.bfloat16):
            inputs = make_inputs(shape, dtype, "cuda", dist="local", seed=1)
            args = inputs.args()
            grad = torch.randn(shape.batch, Q, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
            times = {t: {"graph": [], "profiler": [], "eager": []} for t in THRESHOLDS}
            errors = {}
            for _ in range(3):
                for t in THRESHOLDS:
                    backward.REPLICAS_MIN_SAMPLES_PER_ROW = t
                    call = lambda: torch.ops.msda.backward(grad, *args)  # noqa: E731
                    times[t]["graph"].append(graph_device_time(call, 20, 5).median_us)
                    times[t]["profiler"].append(profiler_device_time(call, 10, 3).median_us)
                    launch = lambda: eager.launch_backward(grad, *args)  # noqa: E731
                    times[t]["eager"].append(end_to_end_time(launch, 50, 3).median_us)
            for t in THRESHOLDS:
                backward.REPLICAS_MIN_SAMPLES_PER_ROW = t
                grad_value = torch.ops.msda.backward(grad, *args)[0]
                _, expected, _, _ = reference_with_grads(inputs, grad)
                errors[t] = relative_error(grad_value.double(), expected)
            backward.REPLICAS_MIN_SAMPLES_PER_ROW = HEAD
            replicas = {t: (Q * L * K > t * S) for t in THRESHOLDS}
            cells = "  ".join(
                f"{t}: graph {statistics.median(times[t]['graph']):7.1f} "
                f"prof {statistics.median(times[t]['profiler']):7.1f} "
                f"eager {statistics.median(times[t]['eager']):7.1f} err {errors[t]:.2e} replicas {replicas[t]}"
                for t in THRESHOLDS
            )
            print(f"{name:24} {str(dtype)[6:]:9} samples/row {Q * L * K / S:.2f}  {cells}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
