"""Scratch A/B (not the bench): float32 encoder forward tiles whose one-warp programs hold two
queries a thread (4 x 2 queries x groups on 32 threads: half the programs of the rule's 2 x 2),
against the rule; plain inputs and every sample outside (no gathers). Graph replay of 20
launches, 3 x 5 rounds in turns, medians, us; the outputs against the rule's."""
import statistics
import torch
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
from msda.testing import PRESETS, make_inputs

def graph_time(fn, reps=20, rounds=5):
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

dtype = torch.float32
rule = launch.forward_config(4, 4, 32, dtype, encoder=True)
variants = {"rule 2x2 w1 r56": (rule, None)}
for regs in (56, 64, 72, 80, 96):
    variants[f"4x2 w1 r{regs}"] = (rule._replace(block_q=4, max_registers=regs), 1)
variants["4x2 w2 r56"] = (rule._replace(block_q=4), None)
variants["4x2 w1 r72 unroll1"] = (rule._replace(block_q=4, max_registers=72, lane_unroll=1), 1)
for dist in ("local", "uniform"):
    inp = make_inputs(PRESETS["encoder"], dtype, "cuda", dist=dist, seed=1)
    B, S, M, D = inp.value.shape
    Q = inp.sampling_locations.shape[1]
    outside = inp.sampling_locations.clone().fill_(-5.0)
    runs, outs = {}, {}
    for name, (cfg, warps) in variants.items():
        out = torch.empty(B, Q, M * D, device="cuda", dtype=dtype)
        grid, args, cx = launch.forward_call(*inp.args(), out, cfg)
        _, args_out, _ = launch.forward_call(inp.value, inp.spatial_shapes, inp.level_start_index, outside,
                                             inp.attention_weights, out, cfg)
        if warps:
            cx = dict(cx, num_warps=warps)
        runs[name] = (lambda g, a, c: (lambda: msda_forward_kernel[g](*a, **c)))(grid, args, cx)
        runs[name + " outside"] = (lambda g, a, c: (lambda: msda_forward_kernel[g](*a, **c)))(grid, args_out, cx)
        runs[name]()
        torch.cuda.synchronize()
        outs[name] = out.clone()
        print(f"{name}: grid {grid[0]}, {cx.get('num_warps')} warps, {cx.get('maxnreg')} registers, "
              f"lane placement {cx['LANE_PLACEMENT']}, max diff to the rule "
              f"{(out - outs['rule 2x2 w1 r56']).abs().max().item():.1e}", flush=True)
    T = {k: [] for k in runs}
    for _ in range(3):
        for k, fn in runs.items():
            T[k] += graph_time(fn)
    base = statistics.median(T["rule 2x2 w1 r56"])
    for k, t in T.items():
        m = statistics.median(t)
        print(f"  {dist:7s} {k:32s} {m:7.2f} us ({min(t):.2f}-{max(t):.2f}) {100 * (m / base - 1):+6.1f}%", flush=True)
