"""The decoder forward at small batches (session 27, call 5).

The decoder rule's 16-query programs of 8 warps make B * M * ceil(Q / 16) programs: 608 at the
preset's B = 4, 304 at B = 2 and 152 at B = 1, so at batch 1 (a real-time detector's inference)
the 132 SMs hold one program each, 8 warps, for a kernel entry 61 found bound by how much is in
flight. Here: the rule against programs taking fewer queries (QUERIES of the 16 slots, more
programs, the same compiled code at any size if QUERIES were a runtime argument) and against
smaller tiles (8 x 2, 4 x 2: other compiled code). Profiler us of the kernel, 3 rounds in turns,
each variant's output compared bit for bit with the rule's."""
import dataclasses
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
    half = dtype != torch.float32
    base = dict(threads_per_row=0, prefetch=dtype != torch.float16, bf16_pairs=dtype == torch.bfloat16,
                lane_placement=True, lane_unroll=4 if half else 2, max_registers=64 if half else 40)
    return {
        "rule 16x2": (T(16, 2, **base), 16),
        "16x2 taking 12": (T(16, 2, **base), 12),
        "16x2 taking 8": (T(16, 2, **base), 8),
        "16x2 taking 4": (T(16, 2, **base), 4),
        "8x2": (T(8, 2, **base), 8),
        "8x2 taking 4": (T(8, 2, **base), 4),
        "4x2": (T(4, 2, **base), 4),
    }


def run(dtype, batch, dist="uniform"):
    shape = dataclasses.replace(PRESETS["decoder"], batch=batch)
    inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=3)
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
        print(f"decoder fwd B={batch} {str(dtype)[6:]} {dist} {k}: {programs} programs of {warps} warps,"
              f" {min(t):.2f}-{max(t):.2f} us, same bits {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.float32, torch.float16):
        for batch in (1, 2, 4, 8):
            run(dtype, batch)
    run(torch.float32, 1, "local")
