"""Measure grad_value's error with native half-precision atomics against the float32 accumulator.

    python -m bench.accumulator

For float16/bfloat16 at the decoder (Q = 300, and DINO's 900) and the encoder, both location
distributions: the relative error of grad_value against the float64 reference when the kernel
scatters into value's dtype directly, and when it scatters into a float32 buffer. This is the
evidence behind HALF_ATOMICS_MAX_SAMPLES_PER_ROW in msda/kernels/backward.py.
"""

from __future__ import annotations

import dataclasses

import torch

from msda.kernels import launch
from msda.kernels.backward import grad_value_accumulator_dtype
from msda.testing import PRESETS, TOLERANCE, make_inputs, reference_with_grads, relative_error

from .tune import backward_launch


def main() -> None:
    shapes = [("decoder", PRESETS["decoder"]), ("decoder Q=900", dataclasses.replace(PRESETS["decoder"], queries=900)),
              ("encoder", PRESETS["encoder"])]
    print(f"{'shape':14s} {'dist':8s} {'dtype':9s} {'native':>9s} {'float32':>9s} {'bound':>8s} rule picks")
    for name, shape in shapes:
        for dist in ("uniform", "local"):
            for dtype in (torch.float16, torch.bfloat16):
                inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=5)
                grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
                expected = reference_with_grads(inputs, grad)[1]
                errors = {}
                for accumulator in (dtype, torch.float32):  # the kernel scatters into this buffer
                    tile = launch.backward_config(len(shape.levels), shape.points, shape.head_dim, dtype)
                    run, (grad_value, _, _) = backward_launch(inputs, grad, tile, accumulator)
                    run()
                    errors[accumulator] = relative_error(grad_value, expected)
                picked = grad_value_accumulator_dtype(dtype, inputs.value.device, shape.queries, shape.num_values, len(shape.levels), shape.points)
                print(f"{name:14s} {dist:8s} {str(dtype)[6:]:9s} {errors[dtype]:9.2e} {errors[torch.float32]:9.2e} "
                      f"{TOLERANCE[dtype]:8.1e} {str(picked)[6:]}")


if __name__ == "__main__":
    main()
