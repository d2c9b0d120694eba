"""Scratch A/B (not the bench): the decoder forward with its coarse levels in programs of their
own (more queries a program: more L1 reuse of the coarse rows), run beside the fine levels'
programs on a second stream, against the rule's one launch. CUDA-graph replay of 20 launches
(fork-join per launch where split), median of rounds in turns, us a call."""
import statistics, sys
import torch
from msda.kernels import launch
from msda.kernels.launch import TileConfig
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

def kernel_time(fn, reps=50):
    """Profiler-free: events around `reps` eager launches back to back (launch-bound if tiny)."""
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps

def part(inp, levels, out, config=None):
    lo, hi = levels
    shapes = inp.spatial_shapes[lo:hi].contiguous()
    starts = inp.level_start_index[lo:hi].contiguous()
    loc = inp.sampling_locations[:, :, :, lo:hi].contiguous()
    attn = inp.attention_weights[:, :, :, lo:hi].contiguous()
    grid, args, cx = launch.forward_call(inp.value, shapes, starts, loc, attn, out, config)
    return lambda: msda_forward_kernel[grid](*args, **cx)

def split(fine, coarse):
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            coarse()
        fine()
        main.wait_stream(side)
    return run

side = None
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
half = dtype != torch.float32
rule = launch.forward_config(4, 4, 32, dtype)
def tile(q, g):
    return rule._replace(block_q=q, groups=g)

for dist in ["uniform", "local"]:
    side = torch.cuda.Stream()
    inp = make_inputs(PRESETS["decoder"], dtype, "cuda", dist=dist, seed=1)
    B, S, M, D = inp.value.shape
    Q = inp.sampling_locations.shape[1]
    new = lambda: torch.empty(B, Q, M * D, device="cuda", dtype=dtype)
    out, o1, o2 = new(), new(), new()
    variants = {"rule": part(inp, (0, 4), out)}
    for cut in (1, 2, 3):
        fine = part(inp, (0, cut), o1)
        for q, g in ((16, 2), (32, 2), (64, 2) if half else (32, 2)):
            coarse = part(inp, (cut, 4), o2, tile(q, g))
            variants[f"0-{cut - 1} | {cut}-3 at {q}x{g}, two streams"] = split(fine, coarse)
        variants[f"0-{cut - 1} | {cut}-3 at 32x2, one stream"] = (lambda f, c: (lambda: (f(), c())))(
            fine, part(inp, (cut, 4), o2, tile(32, 2)))
        variants[f"levels 0-{cut - 1} alone"] = fine
        variants[f"levels {cut}-3 alone at 16x2"] = part(inp, (cut, 4), o2, tile(16, 2))
        variants[f"levels {cut}-3 alone at 32x2"] = part(inp, (cut, 4), o2, tile(32, 2))
    # exactness of the split (sum of two partial outputs against the one launch)
    variants["rule"](); torch.cuda.synchronize(); ref = out.clone()
    part(inp, (0, 2), o1)(); part(inp, (2, 4), o2, tile(32, 2))(); torch.cuda.synchronize()
    print(f"{dist} {dtype}: split sum vs rule max abs diff {(o1.float() + o2.float() - ref.float()).abs().max().item():.2e}",
          flush=True)
    times = {k: [] for k in variants}
    for r in range(3):
        for k, fn in variants.items():
            times[k] += graph_time(fn)
    base = statistics.median(times["rule"])
    for k, t in times.items():
        m = statistics.median(t)
        print(f"  {dist:7s} {k:45s} {m:7.2f} us ({min(t):.2f}-{max(t):.2f}) {100 * (m / base - 1):+6.1f}%", flush=True)
