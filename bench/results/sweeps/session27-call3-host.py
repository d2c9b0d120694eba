"""Where the host time of an eager forward + backward goes (issue 14; session 27, call 3).

The decoder preset at batch 1 (so that the device, ~20 us a step, never sets the pace): the
wall time a call of each piece of the eager path, median of 7 rounds of 200 calls (a
synchronize every 20), then cProfile over 300 forward + backward steps (the main thread's: the forward), and the
inclusive wall time a step of the eager path's functions, wrapped (autograd runs the backward on
its own thread, which cProfile does not see)."""
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

from bench.calls import _NoopFunction  # noqa: E402

shape = dataclasses.replace(PRESETS["decoder"], batch=1)
inputs = make_inputs(shape, torch.float32, "cuda", dist="uniform", seed=3)
value, shapes, starts, loc, attn = inputs.args()
leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
v, l, a = leaves
grad = torch.randn(1, loc.shape[1], value.shape[2] * value.shape[3], device="cuda")
x = torch.zeros(1, device="cuda", requires_grad=True)
tiny = torch.zeros(1, device="cuda")
f = msda.multi_scale_deformable_attention


def wall_us(fn, calls=200, rounds=7):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(calls):
            fn()
            if i % 20 == 19:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(out), min(out)


def forward_no_grad():
    with torch.no_grad():
        return f(value, shapes, starts, loc, attn)


def forward_with_grad():
    return f(v, shapes, starts, l, a)


pieces = {
    "empty in-place add": lambda: tiny.add_(1),
    "trivial autograd step (x * 2) grad": lambda: torch.autograd.grad(x * 2, x, tiny),
    "noop Function forward + grad": lambda: torch.autograd.grad(_NoopFunction.apply(v, shapes, starts, l, a), leaves, grad),
    "noop Function forward (grad on), no backward": lambda: _NoopFunction.apply(v, shapes, starts, l, a),
    "eager.eligible": lambda: eager.eligible(value, shapes, starts, loc, attn),
    "eager._check": lambda: eager._check(value, shapes, starts, loc, attn),
    "launch.compile_shared_tile_ahead": lambda: launch.compile_shared_tile_ahead(value, shapes, starts, loc, attn),
    "torch.empty of the output": lambda: torch.empty(1, 300, 256, device="cuda"),
    "eager.launch_forward": lambda: eager.launch_forward(value, shapes, starts, loc, attn),
    "functional forward, no grad": forward_no_grad,
    "functional forward, grad on, no backward": forward_with_grad,
    "eager.launch_backward": lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
    "torch.zeros like value": lambda: torch.zeros_like(value),
    "functional forward + autograd.grad": lambda: torch.autograd.grad(forward_with_grad(), leaves, grad),
}
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for name, fn in pieces.items():
    med, low = wall_us(fn)
    print(f"{name:48s} {med:8.1f} us (min {low:.1f})", flush=True)

step = pieces["functional forward + autograd.grad"]
for _ in range(20):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for i in range(300):
    step()
    if i % 20 == 19:
        torch.cuda.synchronize()
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(40)
stats.sort_stats("cumulative").print_stats(45)


# Inclusive wall time a step of each function on the eager path, the backward's thread included.
from collections import defaultdict  # noqa: E402


spent = defaultdict(float)


def timed(owner, name, label=None):
    original = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t

    setattr(owner, name, wrapper)


for owner, name in [
    (eager, "differentiable_forward"), (eager, "_check"), (eager, "eligible"), (eager, "launch_forward"),
    (eager, "launch_backward"), (eager, "_kernel_backward_eligible"), (eager, "_launch"),
    (launch, "compile_shared_tile_ahead"), (launch, "forward_call"), (launch, "backward_call"),
    (launch, "shared_tile_applies"), (launch, "empty_written_whole"), (eager, "grad_value_buffer"),
    (eager, "finish_grad_value"),
]:
    timed(owner, name)
forward_impl, backward_impl = eager._Function.forward, eager._Function.backward


def timed_static(fn, label):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t

    return staticmethod(wrapper)


eager._Function.forward = timed_static(forward_impl, "_Function.forward")
eager._Function.backward = timed_static(backward_impl, "_Function.backward")
for _ in range(20):
    step()
torch.cuda.synchronize()
spent.clear()
steps = 300
t0 = time.perf_counter()
for i in range(steps):
    step()
    if i % 20 == 19:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print(f"a step, wrapped: {(time.perf_counter() - t0) * 1e6 / steps:.1f} us")
for label, total in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"  {label:45s} {total * 1e6 / steps:8.1f} us a step")
