"""The float32 encoder backward with its last level summed in shared memory (launch.SHARED_TILE,
msda/kernels/shared_tile.py; bench/NOTES.md entry 49) against the launch rule without it, at the
encoder preset: graph us of the whole backward, profiler us a kernel, errors against float64.

    python -m bench.experiments.shared_tile            # on a Hopper GPU (triton 3.6's Gluon)

tests/gpu/test_gpu_shared_tile.py checks it at shapes the preset does not reach."""
from __future__ import annotations

import torch

from bench.phases import kernel_times
from bench.timing import graph_device_time
from bench.tune import backward_launch
from msda.kernels import launch
from msda.kernels.backward import msda_backward_kernel, zero_
from msda.testing import PRESETS, make_inputs, reference_with_grads, relative_error


def shared_tile_launch(inputs, grad_output, tile: launch.TileConfig, queries_a_program: int):
    """(a callable zeroing grad_value, launching the backward kernel with the last level left out
    and the tile kernel at `queries_a_program` queries a program, its three gradient buffers)."""
    value, shapes, starts, loc, attn = inputs.args()
    grads = (torch.zeros_like(value), torch.empty_like(loc), torch.empty_like(attn))
    grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, *grads, tile,
                                                  shared_tile=True)  # fmt: skip
    saved, launch.SHARED_TILE_QUERIES = launch.SHARED_TILE_QUERIES, queries_a_program
    try:
        tile_grid, tile_args, tile_constexprs = launch.shared_tile_call(grad_output, value, shapes, starts, loc, attn,
                                                                        grads[0])  # fmt: skip
    finally:
        launch.SHARED_TILE_QUERIES = saved

    def run():
        zero_(grads[0])
        msda_backward_kernel[grid](*args, **constexprs)
        launch.msda_shared_tile_kernel[tile_grid](*tile_args, **tile_constexprs)

    return run, grads


def main() -> None:
    def timed(run, grads, expected):
        run()
        torch.cuda.synchronize()
        errors = [relative_error(g, r) for g, r in zip(grads, expected)]
        graph = graph_device_time(run, calls=5, replays=5).median_us
        kernels = ", ".join(f"{name[:24]} {us:.1f}" for name, us in kernel_times(run, 5))
        return f"{graph:.1f} [{kernels}] grad_value error {errors[0]:.1e}, worst {max(errors):.1e}"

    preset = PRESETS["encoder"]
    for dist in ("uniform", "local"):
        inputs = make_inputs(preset, torch.float32, "cuda", dist=dist, seed=3)
        grad = torch.randn(inputs.value.shape[0], preset.queries, preset.heads * preset.head_dim, device="cuda")
        expected = reference_with_grads(inputs, grad)[1:]
        tile = launch.backward_config(4, 4, preset.head_dim, torch.float32, True)
        print(f"encoder {dist} float32, the rule: " + timed(*backward_launch(inputs, grad, tile), expected), flush=True)
        for queries in (128, 256, 64):
            run, grads = shared_tile_launch(inputs, grad, tile, queries)
            print(f"encoder {dist} float32, shared tile, {queries} queries a program: " + timed(run, grads, expected),
                  flush=True)


if __name__ == "__main__":
    main()
