"""Scratch A/B (not the bench): the forward's lane loop taking the levels from (q_block % L) and
round (ROTATE_LEVELS, a scratch constexpr), so that programs in one wave gather different levels
at once, against the plain order (every program level 0 first). CUDA-graph replay of 20 launches,
3 x 7 rounds in turns, medians, us a launch; the outputs' difference."""
import statistics
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

for preset in ("decoder", "encoder"):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dist in ("uniform", "local"):
            inp = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=1)
            B, S, M, D = inp.value.shape
            Q = inp.sampling_locations.shape[1]
            outs = [torch.empty(B, Q, M * D, device="cuda", dtype=dtype) for _ in range(2)]
            runs = []
            for rot, out in zip((False, True), outs):
                grid, args, cx = launch.forward_call(*inp.args(), out)
                cx = dict(cx, ROTATE_LEVELS=rot)
                runs.append((lambda g, a, c: (lambda: msda_forward_kernel[g](*a, **c)))(grid, args, cx))
            for r in runs:
                r()
            torch.cuda.synchronize()
            diff = (outs[0].float() - outs[1].float()).abs().max().item()
            T = [[], []]
            for _ in range(3):
                for i in range(2):
                    T[i] += graph_time(runs[i])
            a, b = statistics.median(T[0]), statistics.median(T[1])
            print(f"{preset} {str(dtype)[6:]:8s} {dist:7s}: plain {a:7.2f} us ({min(T[0]):.2f}-{max(T[0]):.2f}), "
                  f"rotated {b:7.2f} ({min(T[1]):.2f}-{max(T[1]):.2f}), {100 * (b / a - 1):+5.1f}%, max diff {diff:.1e}",
                  flush=True)
