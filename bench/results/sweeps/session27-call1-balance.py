"""Is the float32 decoder bound by how its programs share out over the SMs? (session 27, call 1)

1. Kernel us by the number of queries Q (the decoder preset otherwise): the forward's programs
   are 32 x ceil(Q / 16) (608 at Q = 300: 80 SMs hold 5, 52 hold 4), the backward's 32 x
   ceil(Q / 4) (2,400: two waves of ~1,188 and 24 over).
2. The forward with each 16-query program taking only QUERIES of them (the others masked):
   at 15, 640 programs, 5 a SM at most, 75 queries where 80 now.
Profiler us of the msda kernels alone (and of the rest of the backward: the fill), 3 rounds in
turns; every variant's output is compared bit for bit with the rule's."""
import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.kernels.forward import msda_forward_kernel  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402


def kernel_us(fn, calls=20):
    """(msda kernels, everything else) device us a call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    mine = sum(e.device_time for e in ev if "msda" in e.name) / calls
    rest = sum(e.device_time for e in ev if "msda" not in e.name) / calls
    return mine, rest


def spread(v):
    return f"{min(v):.2f}-{max(v):.2f}"


def q_sweep(dtype):
    for dist in ("uniform", "local"):
        rows = {}
        for Q in (256, 272, 288, 296, 300, 304, 320, 336):
            shape = dataclasses.replace(PRESETS["decoder"], queries=Q)
            inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=3)
            value, shapes, starts, loc, attn = inputs.args()
            B, _, M, D = value.shape
            grad = torch.randn(B, Q, M * D, device="cuda", dtype=dtype)
            rows[Q] = (lambda v, s, st, lo, a: lambda: eager.launch_forward(v, s, st, lo, a))(value, shapes, starts, loc, attn), \
                (lambda g, v, s, st, lo, a: lambda: eager.launch_backward(g, v, s, st, lo, a))(grad, value, shapes, starts, loc, attn)
        times = {Q: ([], [], []) for Q in rows}
        for _ in range(3):
            for Q, (fwd, bwd) in rows.items():
                times[Q][0].append(kernel_us(fwd)[0])
                kernel, fill = kernel_us(bwd)
                times[Q][1].append(kernel)
                times[Q][2].append(fill)
        for Q, (f, b, fill) in times.items():
            print(f"Q sweep {str(dtype)[6:]} {dist} Q={Q}: fwd programs {32 * -(-Q // 16)} kernel {spread(f)}"
                  f" | bwd programs {32 * -(-Q // 4)} kernel {spread(b)} fill {spread(fill)}", flush=True)


def queries_a_program(dtype):
    for dist in ("uniform", "local"):
        inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", dist=dist, seed=3)
        value, shapes, starts, loc, attn = inputs.args()
        B, _, M, D = value.shape
        Q = loc.shape[1]
        reference = eager.launch_forward(value, shapes, starts, loc, attn)
        variants = {}
        for queries in (16, 15, 14, 13, 12):
            out = torch.full_like(reference, float("nan"))
            grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out)
            constexprs = dict(constexprs, QUERIES=queries)
            grid = (-(-Q // queries) * B * M,)
            run = (lambda g, a, c: lambda: msda_forward_kernel[g](*a, **c))(grid, args, constexprs)
            run()
            torch.cuda.synchronize()
            same = torch.equal(out, reference)
            variants[queries] = (run, grid[0], same)
        times = {k: [] for k in variants}
        for _ in range(3):
            for k, (run, _, _) in variants.items():
                times[k].append(kernel_us(run)[0])
        for k, (_, programs, same) in variants.items():
            print(f"queries a program {str(dtype)[6:]} {dist} {k}: {programs} programs, {spread(times[k])} us,"
                  f" same bits {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    queries_a_program(torch.float32)
    queries_a_program(torch.float16)
    q_sweep(torch.float32)
