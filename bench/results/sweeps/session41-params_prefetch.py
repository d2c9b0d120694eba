"""Scratch A/B (not the bench): the encoder forward with each program prefetching into the L2
the locations and weights of the program PARAMS_PREFETCH ids ahead (`prefetch.global.L2`, a
scratch constexpr), against none. Graph replay of 20 launches, 3 x 7 rounds in turns, medians,
us; outputs against the plain kernel's."""
import statistics, sys
import torch
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
from msda.testing import PRESETS, make_inputs

def graph_time(fn, reps=20, rounds=7):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay(); torch.cuda.synchronize()
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return times

sms = torch.cuda.get_device_properties(0).multi_processor_count
distances = [0, 16 * sms, 32 * sms, 64 * sms, 128 * sms]
print("SMs", sms, "distances", distances, flush=True)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for dist in ("local", "uniform"):
        inp = make_inputs(PRESETS["encoder"], dtype, "cuda", dist=dist, seed=1)
        B, S, M, D = inp.value.shape
        Q = inp.sampling_locations.shape[1]
        outs, runs = [], []
        for d in distances:
            out = torch.empty(B, Q, M * D, device="cuda", dtype=dtype)
            grid, args, cx = launch.forward_call(*inp.args(), out)
            runs.append((lambda g, a, c: (lambda: msda_forward_kernel[g](*a, **c)))(grid, args, dict(cx, PARAMS_PREFETCH=d)))
            outs.append(out)
        for r in runs:
            r()
        torch.cuda.synchronize()
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        T = [[] for _ in runs]
        for _ in range(3):
            for i, r in enumerate(runs):
                T[i] += graph_time(r)
        base = statistics.median(T[0])
        row = ", ".join(f"{d}: {statistics.median(t):.2f} ({100 * (statistics.median(t) / base - 1):+.1f}%)"
                        for d, t in zip(distances, T))
        print(f"encoder {str(dtype)[6:]:8s} {dist:7s} bitwise {same}: {row}", flush=True)
