"""Triton's C launcher called directly against `CompiledKernel[grid]` (issue 14; session 28, call 2).

The decoder preset at batch 1 (the device never sets the pace), float32: wall us a call, median
of 200 calls in 10 blocks of 20 with a synchronize each, the two routes taking turns over 8
rounds (ABBA...). "public" patches direct._c_launch to its fallback (one extra Python call
against the code before: the closure), with the launchers' caches cleared at each switch."""
import dataclasses
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels import direct  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

c_launch = direct._c_launch


def public_launch(compiled):
    def launch(grid_x, grid_y, grid_z, stream, *kernel_args):
        compiled[(grid_x, grid_y, grid_z)](*kernel_args, stream=stream)

    return launch, ()


launchers = [eager._forward_kernel, eager._backward_kernel, eager._fold_kernel, *eager._LISTS.values()]
if eager._shared_tile_kernel:
    launchers.append(eager._shared_tile_kernel)


def route(name):
    direct._c_launch = c_launch if name == "c" else public_launch
    for launcher in launchers:
        launcher.compiled.clear()


for batch in (1, 4):
    shape = dataclasses.replace(PRESETS["decoder"], batch=batch)
    inputs = make_inputs(shape, torch.float32, "cuda", dist="uniform", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    v, l, a = leaves
    grad = torch.randn(batch, loc.shape[1], value.shape[2] * value.shape[3], device="cuda")
    tiny = torch.zeros(1, device="cuda")
    f = msda.multi_scale_deformable_attention

    def no_grad():
        with torch.no_grad():
            return f(value, shapes, starts, loc, attn)

    pieces = {
        "empty in-place add": lambda: tiny.add_(1),
        "eager.launch_forward": lambda: eager.launch_forward(value, shapes, starts, loc, attn),
        "functional forward, no grad": no_grad,
        "eager.launch_backward": lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
        "functional forward + autograd.grad": lambda: torch.autograd.grad(f(v, shapes, starts, l, a), leaves, grad),
    }

    def wall_us(fn, calls=200):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            fn()
            if i % 20 == 19:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / calls

    samples = {(r, name): [] for r in ("public", "c") for name in pieces}
    for order in ["public", "c", "c", "public"] * 2:
        route(order)
        for name, fn in pieces.items():
            samples[order, name].append(wall_us(fn))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, decoder batch {batch}, float32: "
          "median (min-max) of 4 rounds a route, us a call", flush=True)
    for name in pieces:
        cells = []
        for r in ("public", "c"):
            t = samples[r, name]
            cells.append(f"{r} {statistics.median(t):7.1f} ({min(t):.1f}-{max(t):.1f})")
        print(f"  {name:38s} " + "   ".join(cells), flush=True)
route("c")
pieces["functional forward + autograd.grad"]()
pieces["functional forward + autograd.grad"]()
entries = [e for x in launchers for e in x.compiled.values()]
print("cached launches:", len(entries), "of them through the C function:",
      sum(isinstance(e[0], types.BuiltinFunctionType) for e in entries))
