"""Scratch A/B (not the bench): the lane loops' corner tests as one `and` + compare in inline PTX
(BIT_PTX, a scratch constexpr) against Triton's (x & b) != 0 (a shift, an and, a compare).
Forward: graph replay of 20 launches; backward: graph replay of 20 x (torch's zero fill of
grad_value + the backward kernel), no shared tile. 3 x 7 rounds in turns, medians, us."""
import statistics, sys
import torch
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
from msda.kernels.backward import msda_backward_kernel
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

def ab(label, runs, check):
    for r in runs:
        r()
    torch.cuda.synchronize()
    same = check()
    T = [[], []]
    for _ in range(3):
        for i in range(2):
            T[i] += graph_time(runs[i])
    a, b = statistics.median(T[0]), statistics.median(T[1])
    print(f"{label}: plain {a:8.2f} us ({min(T[0]):.2f}-{max(T[0]):.2f}), ptx tests {b:8.2f} "
          f"({min(T[1]):.2f}-{max(T[1]):.2f}), {100 * (b / a - 1):+5.1f}%, {same}", flush=True)

which = sys.argv[1:] or ["fwd", "bwd"]
cells = [(p, d, dist) for p in ("decoder", "encoder") for d in (torch.float32, torch.float16, torch.bfloat16)
         for dist in ("uniform", "local")]
if "fwd" in which:
    for preset, dtype, dist in cells:
        inp = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=1)
        B, S, M, D = inp.value.shape
        Q = inp.sampling_locations.shape[1]
        outs = [torch.empty(B, Q, M * D, device="cuda", dtype=dtype) for _ in range(2)]
        runs = []
        for bit, out in zip((False, True), outs):
            grid, args, cx = launch.forward_call(*inp.args(), out)
            runs.append((lambda g, a, c: (lambda: msda_forward_kernel[g](*a, **c)))(grid, args, dict(cx, BIT_PTX=bit)))
        ab(f"fwd {preset} {str(dtype)[6:]:8s} {dist:7s}", runs, lambda: f"bitwise {torch.equal(outs[0], outs[1])}")
if "bwd" in which:
    for preset, dtype, dist in cells:
        if preset == "encoder" and dtype != torch.float32:
            continue  # replicas and a fold: the decoders and the float32 encoder's kernel suffice here
        inp = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=1)
        B, S, M, D = inp.value.shape
        Q = inp.sampling_locations.shape[1]
        go = torch.randn(B, Q, M * D, device="cuda", dtype=dtype)
        from msda.kernels.backward import grad_value_accumulator_dtype, replica_rows
        acc = grad_value_accumulator_dtype(inp.value, Q, 4, 4)
        assert replica_rows(acc, Q, S, 4, 4) is None, "replicas"
        bufs = []
        runs = []
        for bit in (False, True):
            gv = torch.zeros(inp.value.shape, device="cuda", dtype=acc)
            gl = torch.empty_like(inp.sampling_locations)
            ga = torch.empty_like(inp.attention_weights)
            grid, args, cx = launch.backward_call(go, *inp.args(), gv, gl, ga)
            cx = dict(cx, BIT_PTX=bit)
            def run(gv=gv, grid=grid, args=args, cx=cx):
                gv.zero_()
                msda_backward_kernel[grid](*args, **cx)
            runs.append(run)
            bufs.append((gv, gl, ga))
        def check():
            (g0, l0, a0), (g1, l1, a1) = bufs
            return (f"grad_loc bitwise {torch.equal(l0, l1)}, grad_attn bitwise {torch.equal(a0, a1)}, "
                    f"grad_value max diff {(g0.float() - g1.float()).abs().max().item():.1e}")
        ab(f"bwd {preset} {str(dtype)[6:]:8s} {dist:7s}", runs, check)
