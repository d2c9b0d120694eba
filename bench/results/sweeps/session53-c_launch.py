"""Triton's C launcher called directly against `CompiledKernel[grid]`, on the installed triton
(session 53: the C launch on 3.7/3.8's tuple form; entry 64 measured 3.6's).

session28-call2-direct_launch.py's A/B, which since entry 73 no longer switched routes: the
eager path's prepared launches (`eager._forward_launches`, ...) kept the first route's launch.
Here each switch clears them too. The decoder preset, float32, batch 1 and 4: wall us a call,
median of 200 calls in 10 blocks of 20 with a synchronize each, the routes taking turns over 8
rounds (ABBA...). "public" is `direct._c_launch`'s fallback, `compiled[grid](..., stream=)`."""
import dataclasses
import statistics
import sys
import time

import torch
import triton

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
prepared = [eager._forward_launches, eager._backward_launches, eager._fold_launches]


def route(name):
    direct._c_launch = c_launch if name == "c" else public_launch
    for cache in [launcher.compiled for launcher in launchers] + prepared:
        cache.clear()


def routes_taken():
    """Each prepared launch's route: "c" (3.6's C function itself, or 3.7's closure over it) or "public"."""
    taken = []
    for cache in prepared:
        for launch in cache.values():
            if launch is not None:
                code = getattr(launch.launch, "__code__", None)
                taken.append("c" if code is None or "c_function" in code.co_freevars else "public")
    return taken


print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
for batch in (1, 4):
    shape = dataclasses.replace(PRESETS["decoder"], batch=batch)
    inputs = make_inputs(shape, torch.float32, "cuda", dist="uniform", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    v, loc_leaf, a = leaves
    grad = torch.randn(batch, loc.shape[1], value.shape[2] * value.shape[3], device="cuda")
    f = msda.multi_scale_deformable_attention

    def no_grad():
        with torch.no_grad():
            return f(value, shapes, starts, loc, attn)

    pieces = {
        "eager.launch_forward": lambda: eager.launch_forward(value, shapes, starts, loc, attn),
        "functional forward, no grad": no_grad,
        "eager.launch_backward": lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
        "functional forward + autograd.grad": lambda: torch.autograd.grad(f(v, shapes, starts, loc_leaf, a), leaves, grad),
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
        assert set(routes_taken()) == {order}, (order, routes_taken())
    print(f"decoder batch {batch}, float32: median (min-max) of 4 rounds a route, us a call", flush=True)
    for name in pieces:
        cells = []
        for r in ("public", "c"):
            t = samples[r, name]
            cells.append(f"{r} {statistics.median(t):7.1f} ({min(t):.1f}-{max(t):.1f})")
        print(f"  {name:38s} " + "   ".join(cells), flush=True)
print("prepared launches in the last round:", len(routes_taken()), "all", routes_taken()[0])
