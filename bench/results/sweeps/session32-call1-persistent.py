"""The encoder forward as persistent programs, each a run of consecutive query blocks (session 32, calls 1-2).

Why: under `local` an encoder query's samples lie within a few pixels of its own, so neighbouring
queries of one head share value rows; today's one-warp programs of 2 queries are dealt round the
SMs, so the 32 warps an SM holds at once sample 32 places of the image and its L1 (44% hits by
ncu, entry 60) keeps little of what a neighbour loaded. A grid of as many programs as the SMs
hold, each walking its own run of consecutive query blocks, puts neighbouring queries on one SM:
with one program of 32 warps an SM, its warps take 64 consecutive queries at a time (a third of
an image row at level 0). No claim or atomic (entry 55's claims cost a round trip a program).
Call 1 gave each program a run of consecutive blocks (`persistent` > 0, the rows above): slower
everywhere, the one-warp control too (all heads active at once). Call 2 (both calls' variants
are listed below; each call ran the rule and its own): grid-stride programs
(`persistent` < 0), whose steps take consecutive blocks as the rule's programs do.
Profiler us of the msda kernel, three rounds in turns; outputs compared bit for bit with the rule's.
Needs session32-call1-persistent.diff applied (`git apply`; call 2's variant, the strided order,
is in it too); bench/NOTES.md entry 70 has the results."""
import sys

import torch

sys.path.insert(0, ".")
from bench.timing import profiler_device_time  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.kernels.forward import msda_forward_kernel  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

T = launch.TileConfig


def variants_for(dtype):
    if dtype == torch.float32:
        base = dict(threads_per_row=0, prefetch=True, lane_placement=True, lane_unroll=2, max_registers=56)
        return {
            "rule 2x2 @56": T(2, 2, **base),
            # call 1
            "persistent 64x2, 1 a SM": T(64, 2, **base, persistent=1),
            "persistent 32x2, 2 a SM": T(32, 2, **base, persistent=2),
            "persistent 16x2, 4 a SM": T(16, 2, **base, persistent=4),
            "persistent 2x2, 32 a SM": T(2, 2, **base, persistent=32),
            "32x2 @56, not persistent": T(32, 2, **base),
            # call 2
            "strided 64x2, 1 a SM": T(64, 2, **base, persistent=-1),
            "strided 32x2, 2 a SM": T(32, 2, **base, persistent=-2),
            "strided 16x2, 4 a SM": T(16, 2, **base, persistent=-4),
            "strided 2x2, 32 a SM": T(2, 2, **base, persistent=-32),
            "strided 2x2, 16 a SM": T(2, 2, **base, persistent=-16),
        }
    base = dict(threads_per_row=0, prefetch=dtype != torch.float16, bf16_pairs=dtype == torch.bfloat16,
                lane_placement=True, lane_unroll=4, max_registers=64)
    return {
        "rule 4x2 @64": T(4, 2, **base),
        "persistent 128x2, 1 a SM": T(128, 2, **base, persistent=1),  # call 1
        "persistent 64x2, 2 a SM": T(64, 2, **base, persistent=2),
        "persistent 4x2, 32 a SM": T(4, 2, **base, persistent=32),
        "strided 128x2, 1 a SM": T(128, 2, **base, persistent=-1),
        "strided 64x2, 2 a SM": T(64, 2, **base, persistent=-2),
        "strided 4x2, 32 a SM": T(4, 2, **base, persistent=-32),
    }


def run(dtype, dist):
    inputs = make_inputs(PRESETS["encoder"], dtype, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    reference = eager.launch_forward(value, shapes, starts, loc, attn)
    variants = {}
    for name, config in variants_for(dtype).items():
        out = torch.full_like(reference, float("nan"))
        grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out, config)
        fn = (lambda g, a, c: lambda: msda_forward_kernel[g](*a, **c))(grid, args, constexprs)
        fn()
        torch.cuda.synchronize()
        variants[name] = (fn, grid[0], constexprs["num_warps"], torch.equal(out, reference))
    times = {k: [] for k in variants}
    for _ in range(3):
        for k, (fn, *_) in variants.items():
            times[k].append(profiler_device_time(fn, calls=10, repeats=2).median_us)
    for k, (_, programs, warps, same) in variants.items():
        t = times[k]
        print(f"encoder fwd {str(dtype)[6:]} {dist} {k}: {programs} programs of {warps} warps,"
              f" {min(t):.1f}-{max(t):.1f} us, same bits {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dist in ("local", "uniform"):
            run(dtype, dist)
