"""Measure grad_value's error and the backward's time for each way of summing it in half precision.

    python -m bench.accumulator

For float16/bfloat16 at the decoder (Q = 300, and DINO's 900) and the encoder, both location
distributions: the relative error of grad_value against the float64 reference, and the
backward's device time (graph replay, zeroing and the fold included, not the float32 cast), when the
kernel scatters into value's dtype directly, into value's dtype with replicas of the dense
levels (`level_replicas`), and into a float32 buffer. This is the evidence behind
SAMPLES_PER_REPLICA in msda/kernels/backward.py (bench/NOTES.md entries 33 and 97).
"""

from __future__ import annotations

import dataclasses

import torch

from msda.kernels import launch
from msda.kernels.backward import replica_rows
from msda.testing import PRESETS, TOLERANCE, make_inputs, reference_with_grads, relative_error

from .timing import graph_device_time
from .tune import backward_launch

WAYS = {"native": (None, False), "replicas": (None, True), "float32": (torch.float32, False)}  # (accumulator, replicas)


def main() -> None:
    shapes = [("decoder", PRESETS["decoder"]), ("decoder Q=900", dataclasses.replace(PRESETS["decoder"], queries=900)),
              ("encoder", PRESETS["encoder"])]
    print(f"{'shape':14s} {'dist':8s} {'dtype':9s} " + " ".join(f"{w:>20s}" for w in WAYS) + f" {'bound':>8s} rule")
    for name, shape in shapes:
        for dist in ("uniform", "local"):
            for dtype in (torch.float16, torch.bfloat16):
                inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=5)
                grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
                expected = reference_with_grads(inputs, grad)[1]
                cells = []
                for accumulator, replicas in WAYS.values():
                    tile = launch.backward_config(len(shape.levels), shape.points, shape.head_dim, dtype)
                    run, (grad_value, _, _) = backward_launch(inputs, grad, tile, accumulator or dtype, replicas)
                    run()
                    error = relative_error(grad_value.to(dtype), expected)
                    cells.append(f"{error:9.2e} {graph_device_time(run, calls=10, replays=5).median_us:7.1f} us")
                rows = replica_rows(dtype, shape.queries, shape.num_values, len(shape.levels), shape.points)
                rule = "native" if rows is None else "replicas"
                print(f"{name:14s} {dist:8s} {str(dtype)[6:]:9s} " + " ".join(f"{c:>20s}" for c in cells)
                      + f" {TOLERANCE[dtype]:8.1e} {rule}", flush=True)


if __name__ == "__main__":
    main()
