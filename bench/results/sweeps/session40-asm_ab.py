"""Scratch A/B (not the bench): the forward kernel's corner adds as predicated 16-byte loads and
predicated FMAs (ASM_LOADS, no registers zeroed) against the plain masked loads. CUDA-graph
replay of 20 launches, median of rounds in turns, us a launch; bitwise check; NaN-weight check.

It needs the scratch ASM_LOADS constexpr of msda_forward_kernel, not kept (bench/NOTES.md entry 86
describes it): the tree as committed has no such argument."""
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

def case(preset, dist, dtype=torch.float32):
    inp = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=1)
    B, S, M, D = inp.value.shape
    Q = inp.sampling_locations.shape[1]
    out = torch.empty(B, Q, M * D, device="cuda", dtype=dtype)
    grid, args, cx = launch.forward_call(*inp.args(), out)
    def run(asm):
        c = dict(cx, ASM_LOADS=asm)
        return lambda: msda_forward_kernel[grid](*args, **c)
    return inp, out, grid, args, cx, run

for preset, dist in [("encoder", "uniform"), ("encoder", "local"), ("decoder", "uniform"), ("decoder", "local")]:
    inp, out, grid, args, cx, run = case(preset, dist)
    run(False)(); torch.cuda.synchronize(); ref = out.clone()
    run(True)(); torch.cuda.synchronize()
    same = torch.equal(out, ref)
    # NaN weights on samples entirely outside: the output must be NaN for those (query, head) either way
    loc, attn = inp.sampling_locations.clone(), inp.attention_weights.clone()
    loc[0, :5, 0, 0, 0] = torch.tensor([-3.0, -3.0], device="cuda"); attn[0, :5, 0, 0, 0] = float("nan")
    args2 = (args[0], args[1], args[2], loc, attn, out, *args[6:])
    c = dict(cx, ASM_LOADS=True); msda_forward_kernel[grid](*args2, **c); torch.cuda.synchronize()
    D = inp.value.shape[3]
    nan_ok = bool(torch.isnan(out[0, :5, :D]).all()) and bool(torch.isfinite(out[0, 5:, :D]).all())
    A, Bt = [], []
    for r in range(3):
        A += graph_time(run(False)); Bt += graph_time(run(True))
    a, b = statistics.median(A), statistics.median(Bt)
    print(f"{preset} {dist} fp32: plain {a:.2f} us ({min(A):.2f}-{max(A):.2f}), asm {b:.2f} ({min(Bt):.2f}-{max(Bt):.2f}), "
          f"{100 * (b / a - 1):+.1f}%, bitwise {same}, nan {nan_ok}", flush=True)
