"""Entry 70's fixed-grid loss: imbalance within an SM or across SMs? (session 32, call 9).

Entry 70's strided one-warp loop (the rule's order and tile, 32 programs a SM, each walking
blocks pid, pid + P, ...) ran 12-18% slower than the rule in float32. Here the same loop takes
its blocks by claims, each claimed a block ahead: CLAIMS=1, each SM's warps claim the SM's
blocks sm, sm + 132, ... from that SM's counter (balances the warps of an SM, not the SMs);
CLAIMS=n > 1, claims of n consecutive blocks from one global counter (balances the SMs too;
about 2 ns an atomic on one address, entry 55). Needs session32-call9-claims.diff applied (it
holds entry 70's variant too). Every variant, the rule included, zeroes the counters before
its launch. Profiler us of a call (the fill included), three rounds in turns; outputs compared
bit for bit with the rule's."""
import sys

import torch

sys.path.insert(0, ".")
from bench.timing import profiler_device_time  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.kernels.forward import msda_forward_kernel  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

T = launch.TileConfig
BASE = dict(threads_per_row=0, prefetch=True, lane_placement=True, lane_unroll=2, max_registers=56)
VARIANTS = {
    "rule 2x2 @56": (T(2, 2, **BASE), 0),
    "strided, fixed": (T(2, 2, **BASE, persistent=-32), 0),
    "strided, claimed from the SM's counter": (T(2, 2, **BASE, persistent=-32), 1),
    "claims of 2 blocks, one counter": (T(2, 2, **BASE, persistent=-32), 2),
    "claims of 4 blocks, one counter": (T(2, 2, **BASE, persistent=-32), 4),
    "claims of 8 blocks, one counter": (T(2, 2, **BASE, persistent=-32), 8),
}


def run(dist):
    inputs = make_inputs(PRESETS["encoder"], torch.float32, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    reference = eager.launch_forward(value, shapes, starts, loc, attn)
    counters = torch.zeros(1025, dtype=torch.int32, device="cuda")
    variants = {}
    for name, (config, claims) in VARIANTS.items():
        out = torch.full_like(reference, float("nan"))
        grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out, config)
        args, constexprs = (*args[:-1], counters), dict(constexprs, CLAIMS=claims)

        def fn(g=grid, a=args, c=constexprs):
            counters.zero_()
            msda_forward_kernel[g](*a, **c)

        fn()
        torch.cuda.synchronize()
        variants[name] = (fn, grid[0], torch.equal(out, reference))
    times = {k: [] for k in variants}
    for _ in range(3):
        for k, (fn, *_) in variants.items():
            times[k].append(profiler_device_time(fn, calls=10, repeats=2).median_us)
    for k, (_, programs, same) in variants.items():
        t = times[k]
        print(f"encoder fwd float32 {dist} {k}: {programs} programs, {min(t):.1f}-{max(t):.1f} us, same bits {same}",
              flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, torch.cuda.get_device_properties(0).multi_processor_count,
          "SMs", flush=True)
    for dist in ("local", "uniform"):
        run(dist)
