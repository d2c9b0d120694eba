"""Does an eager forward + backward wait for the GPU, and which CUDA calls does it make? (session 33, call 2)

On this repo's CPU machine, the launches stubbed, msda's step (forward + torch.autograd.grad)
costs 38 us more than bench.calls' do-nothing autograd Function (143.5 against 105.8); on H200
hosts 170-230 more (bench/NOTES.md entries 64, 66, 71). Three launches and a few CUDA
allocations do not explain the difference. Two probes:

1. A 2 ms `torch.cuda._sleep` enqueued first, then one call timed on the host without a
   synchronize: a call that returns in microseconds never waits for the GPU; one that takes
   ~2 ms waits for it somewhere.
2. torch.profiler (CPU and CUDA activities) over 50 steps of each: the CUDA runtime and driver
   calls each step makes and their host time (cudaLaunchKernel, cudaMemsetAsync, event and
   stream calls, any synchronize), and the aten ops.
"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import msda  # noqa: E402
from bench.calls import _NoopFunction  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    inputs = make_inputs(PRESETS["decoder"], torch.float32, "cuda", dist="uniform", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda")
    f = msda.multi_scale_deformable_attention
    x = torch.zeros(1, device="cuda")

    def empty_add():
        x.add_(0)

    def noop_step():
        v, l, a = leaves
        torch.autograd.grad(_NoopFunction.apply(v, shapes, starts, l, a), leaves, grad)

    def fwd_no_grad():
        with torch.no_grad():
            f(value, shapes, starts, loc, attn)

    def fwd_grad():
        v, l, a = leaves
        f(v, shapes, starts, l, a)

    def step():
        v, l, a = leaves
        torch.autograd.grad(f(v, shapes, starts, l, a), leaves, grad)

    calls = {"empty add": empty_add, "noop step": noop_step, "msda fwd no grad": fwd_no_grad,
             "msda fwd with grad": fwd_grad, "msda step": step}
    for fn in calls.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()

    cycles = 4_000_000  # ~2 ms at 1.98 GHz
    print("\n1. host us of one call behind a ~2 ms sleep kernel (median of 7; in brackets: with nothing queued)")
    for name, fn in calls.items():
        behind, alone = [], []
        for _ in range(7):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t = time.perf_counter()
            fn()
            behind.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            alone.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
        print(f"  {name:<22} {statistics.median(behind):9.1f}  ({statistics.median(alone):7.1f})", flush=True)

    print("\n2. 50 calls each under torch.profiler (CPU + CUDA): self CPU time per call, us")
    for name in ("noop step", "msda step", "msda fwd no grad"):
        fn = calls[name]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {name}")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for e in rows[:28]:
            print(f"  {e.key[:60]:<60} calls/step {e.count / 50:5.2f}  self CPU us/step {e.self_cpu_time_total / 50:8.1f}"
                  f"  CUDA us/step {e.self_device_time_total / 50:7.1f}")


if __name__ == "__main__":
    main()
