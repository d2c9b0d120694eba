"""Scratch (not the bench): what a forward (the decoder preset, or the presets named) costs without its gathers (every
sample outside its level: parameters loaded, samples placed, no corner row read), against the
plain call, and an empty Triton kernel of the same grid; graph replay of 20 launches and the
profiler's kernel time, us."""
import statistics
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
from msda.testing import PRESETS, make_inputs

@triton.jit
def empty_kernel(out_ptr):
    pass

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
    return statistics.median(times)

def profiler_time(fn, reps=50):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return statistics.median([e.device_time for e in ks])

import sys
presets = sys.argv[1:] or ["decoder"]
for preset, dtype in [(p, d) for p in presets for d in (torch.float32, torch.float16)]:
    for dist in ("uniform", "local"):
        inp = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=1)
        B, S, M, D = inp.value.shape
        Q = inp.sampling_locations.shape[1]
        out = torch.empty(B, Q, M * D, device="cuda", dtype=dtype)
        outside = inp.sampling_locations.clone().fill_(-5.0)
        grid, args, cx = launch.forward_call(*inp.args(), out)
        _, args_out, _ = launch.forward_call(inp.value, inp.spatial_shapes, inp.level_start_index, outside,
                                             inp.attention_weights, out)
        runs = {
            "plain": lambda: msda_forward_kernel[grid](*args, **cx),
            "every sample outside": lambda: msda_forward_kernel[grid](*args_out, **cx),
            "empty kernel, same grid": lambda: empty_kernel[grid](out, num_warps=cx["num_warps"]),
        }
        for name, fn in runs.items():
            g = [graph_time(fn) for _ in range(3)]
            p = [profiler_time(fn) for _ in range(3)]
            print(f"{preset} {str(dtype)[6:]:8s} {dist:7s} {name:26s} graph {statistics.median(g):6.2f} us, "
                  f"profiler {statistics.median(p):6.2f} us", flush=True)
