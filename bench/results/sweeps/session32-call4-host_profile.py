"""Where an eager forward + backward spends the GPU host's time (session 32, call 4; issue 14).

The decoder preset at batch 1, float32: a do-nothing autograd.Function's step (bench.calls'
floor) against msda's (forward + torch.autograd.grad), each timed plainly (median of 5 rounds
of 500 steps, a synchronize each round) and then under cProfile (the top functions by self time).
On the CPU machine, with the launches stubbed, msda's step costs 1.6x the do-nothing one; entry
64 measured 3.7x on an H200 host: which functions hold the difference there?"""
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from bench.calls import _NoopFunction  # noqa: E402
from msda import eager  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

shape = dataclasses.replace(PRESETS["decoder"], batch=1)
inputs = make_inputs(shape, torch.float32, "cuda", seed=3)
value, shapes, starts, loc, attn = inputs.args()
leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda")
x = torch.zeros(1, device="cuda")


def empty_add():
    x.add_(0)


def noop_step():
    v, l, a = leaves
    torch.autograd.grad(_NoopFunction.apply(v, shapes, starts, l, a), leaves, grad)


def msda_step():
    v, l, a = leaves
    torch.autograd.grad(eager.forward(v, shapes, starts, l, a), leaves, grad)


def forward_no_grad():
    with torch.no_grad():
        eager.forward(value, shapes, starts, loc, attn)


def forward_with_grad():
    v, l, a = leaves
    return eager.forward(v, shapes, starts, l, a)


def backward_only():
    eager.launch_backward(grad, value, shapes, starts, loc, attn)


def timed(fn, steps=500, rounds=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(out), min(out), max(out)


print(torch.cuda.get_device_name(), torch.__version__, "batch", value.shape[0], flush=True)
rows = [("empty add", empty_add), ("do-nothing step", noop_step), ("msda forward, no grad", forward_no_grad),
        ("msda forward with grad, no backward", forward_with_grad), ("launch_backward", backward_only),
        ("msda step", msda_step)]
for _ in range(2):
    for name, fn in rows:
        med, lo, hi = timed(fn)
        print(f"{name:40s} {med:7.1f} us ({lo:.1f}-{hi:.1f})", flush=True)
for name, fn in (("do-nothing step", noop_step), ("msda step", msda_step)):
    timed(fn, steps=100, rounds=1)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        fn()
    torch.cuda.synchronize()
    profile.disable()
    print(f"== cProfile, 2000 x {name}", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)
