"""The decoder forward with larger programs (session 27, call 2).

Call 1 found the float32 decoder forward's time proportional to its queries (7.6 us at Q = 256,
8.9 at 300, 9.9 at 336) and not to the programs an SM holds (15 queries a program, 640 programs,
moved it 1-2%): a throughput bound shared by the whole GPU, most likely the L2. Within a program
the queries of one head share the coarse levels' rows in L1: 32 queries a program instead of 16
would take the hits from ~13% to ~21% of the corner rows (an estimate from the levels' sizes),
~9% fewer L2 sectors. 32 x 2 was measured at 32 registers only (10.4 us, entry 36); at 40 its
320 programs of 16 warps fit in one wave (3 a SM). Half precision: 32 x 2 is 8 warps there.
Profiler us of the msda kernel, 3 rounds in turns; outputs compared bit for bit with the rule's."""
import sys

import torch

sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.kernels.forward import msda_forward_kernel  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

T = launch.TileConfig


def kernel_us(fn, calls=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "msda" in e.name]
    return sum(e.device_time for e in ev) / calls


def variants_for(dtype):
    if dtype == torch.float32:
        base = dict(threads_per_row=0, prefetch=True, lane_placement=True, lane_unroll=2, max_registers=40)
        return {
            "rule 16x2 @40": (T(16, 2, **base), 16),
            "16x2 @40, 15 queries": (T(16, 2, **base), 15),
            "32x2 @40": (T(32, 2, **base), 32),
            "32x2 @40, 30 queries": (T(32, 2, **base), 30),
            "32x2 @40, 25 queries": (T(32, 2, **base), 25),
            "32x2 @40, one turn a step": (T(32, 2, **dict(base, lane_unroll=1)), 32),
            "32x2 @36": (T(32, 2, **dict(base, max_registers=36)), 32),
        }
    pairs = dtype == torch.bfloat16
    base = dict(threads_per_row=0, prefetch=dtype != torch.float16, bf16_pairs=pairs, lane_placement=True,
                lane_unroll=4, max_registers=64)
    return {
        "rule 16x2 @64": (T(16, 2, **base), 16),
        "32x2 @64": (T(32, 2, **base), 32),
        "32x2 @64, 30 queries": (T(32, 2, **base), 30),
        "64x2 @64": (T(64, 2, **base), 64),
        "64x2 @64, 60 queries": (T(64, 2, **base), 60),
        "32x2 @56": (T(32, 2, **dict(base, max_registers=56)), 32),
    }


def run(dtype, dist):
    inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    B, _, M, D = value.shape
    Q = loc.shape[1]
    reference = eager.launch_forward(value, shapes, starts, loc, attn)
    variants = {}
    for name, (config, queries) in variants_for(dtype).items():
        out = torch.full_like(reference, float("nan"))
        grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out, config)
        constexprs = dict(constexprs, QUERIES=queries)
        grid = (-(-Q // queries) * B * M,)
        fn = (lambda g, a, c: lambda: msda_forward_kernel[g](*a, **c))(grid, args, constexprs)
        fn()
        torch.cuda.synchronize()
        variants[name] = (fn, grid[0], constexprs["num_warps"], torch.equal(out, reference))
    times = {k: [] for k in variants}
    for _ in range(3):
        for k, (fn, *_) in variants.items():
            times[k].append(kernel_us(fn))
    for k, (_, programs, warps, same) in variants.items():
        t = times[k]
        print(f"decoder fwd {str(dtype)[6:]} {dist} {k}: {programs} programs of {warps} warps,"
              f" {min(t):.2f}-{max(t):.2f} us, same bits {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dist in ("uniform", "local"):
            run(dtype, dist)
