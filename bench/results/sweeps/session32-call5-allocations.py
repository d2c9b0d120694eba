"""The eager path's allocations through empty_like / new_empty instead of torch.empty (session 32,
call 5; issue 14; bench/NOTES.md entry 71).

Call 4's cProfile of an eager forward + backward on an H200 host put torch.empty at ~20 us a call
(four a step) against ~3 us for the do-nothing Function's empty_like. Here: (1) the allocation
forms alone, at the decoder preset's batch-1 sizes; (2) the eager rows of call 4 with the msda
package at MSDA_ROOT (the run script alternates the tree before the change, a copy in
.scratch/old, and after it, one process each, rounds in turns). Wall us a call, median (min-max)
of 5 rounds of 500 calls, a synchronize each round."""
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.environ.get("MSDA_ROOT", "."))
import msda  # noqa: E402
from bench.calls import _NoopFunction  # noqa: E402
from msda import eager  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402


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
    return f"{statistics.median(out):7.1f} us ({min(out):.1f}-{max(out):.1f})"


def rows(batch):
    inputs = make_inputs(dataclasses.replace(PRESETS["decoder"], batch=batch), torch.float32, "cuda", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda")

    def noop_step():
        v, l, a = leaves
        torch.autograd.grad(_NoopFunction.apply(v, shapes, starts, l, a), leaves, grad)

    def msda_step():
        v, l, a = leaves
        torch.autograd.grad(eager.forward(v, shapes, starts, l, a), leaves, grad)

    def forward_no_grad():
        with torch.no_grad():
            eager.forward(value, shapes, starts, loc, attn)

    shape = (value.shape[0], loc.shape[1], value.shape[2] * value.shape[3])
    allocations = {
        "torch.empty(value.shape, dtype=, device=)": (
            lambda: torch.empty(value.shape, dtype=value.dtype, device=value.device)
        ),
        "torch.empty_like(value, contiguous)": lambda: torch.empty_like(value, memory_format=torch.contiguous_format),
        "value.new_empty(value.shape)": lambda: value.new_empty(value.shape),
        "torch.empty(out shape, dtype=, device=)": lambda: torch.empty(shape, dtype=value.dtype, device=value.device),
        "value.new_empty(out shape)": lambda: value.new_empty(shape),
        "torch.empty_like(loc, contiguous)": lambda: torch.empty_like(loc, memory_format=torch.contiguous_format),
    }
    calls = {"do-nothing step": noop_step, "msda forward, no grad": forward_no_grad,
             "launch_backward": lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
             "msda step": msda_step}
    return allocations, calls


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, "msda from", os.path.dirname(msda.__file__), flush=True)
    for batch in (1, 4):
        allocations, calls = rows(batch)
        if os.environ.get("ALLOCATIONS"):
            for name, fn in allocations.items():
                print(f"batch {batch} {name:45s} {timed(fn)}", flush=True)
        for name, fn in calls.items():
            print(f"batch {batch} {name:45s} {timed(fn)}", flush=True)
