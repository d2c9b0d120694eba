"""Forward tiles (with query passes: the session-26 diff applied) at the decoder, back to back and
after the value is rewritten; profiler us of the msda kernel, min-max of 3 rounds in turns."""
import sys, torch
sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
from msda.testing import PRESETS, make_inputs
from bench.tune import _tiles


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


P = "prefetch=1,lane_placement=1"
TILES = {
    torch.float32: [f"16,2,0,{P},lane_unroll=2,max_registers=40", f"8,2,0,{P},lane_unroll=2,max_registers=64,query_passes=2",
                    f"8,2,0,{P},lane_unroll=4,max_registers=96,query_passes=2", f"4,2,0,{P},lane_unroll=8,max_registers=128,query_passes=4",
                    f"16,2,0,{P},lane_unroll=4,max_registers=48"],
    torch.float16: [f"16,2,0,{P},lane_unroll=4,max_registers=64", f"8,2,0,{P},lane_unroll=4,max_registers=96,query_passes=2",
                    f"4,2,0,{P},lane_unroll=8,max_registers=128,query_passes=4"],
}
for dtype, tiles in TILES.items():
    for dist in ("uniform", "local"):
        inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", dist=dist, seed=3)
        value, shapes, starts, loc, attn = inputs.args()
        source = value.clone()
        B, S, M, D = value.shape
        out = torch.empty(B, loc.shape[1], M * D, dtype=dtype, device="cuda")
        ref = None
        runs = {}
        for text in tiles:
            grid, args, cx = launch.forward_call(value, shapes, starts, loc, attn, out, _tiles(text))
            run = (lambda g, a, c: lambda: msda_forward_kernel[g](*a, **c))(grid, args, cx)
            run(); torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            if not torch.equal(out, ref):
                print("not the same bits:", text, (out.float() - ref.float()).abs().max().item(), flush=True)
            runs[text] = run
        times = {(t, st): [] for t in runs for st in ("warm", "fresh")}
        for _ in range(3):
            for t, run in runs.items():
                times[(t, "warm")].append(kernel_us(run))
                times[(t, "fresh")].append(kernel_us(lambda: (value.copy_(source), run())))
        for t in runs:
            w, f = times[(t, "warm")], times[(t, "fresh")]
            print(f"decoder {dist} {str(dtype)[6:]} {t}: back to back {min(w):.2f}-{max(w):.2f}; value rewritten {min(f):.2f}-{max(f):.2f}", flush=True)
