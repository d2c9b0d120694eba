"""The decoder forward's kernel time by what the L2 holds before it (profiler us, msda kernels only):
back to back (the bench), after a 256 MB fill (nothing of value in L2), after value is rewritten
(as a model's value projection leaves it). 3 rounds in turns."""
import sys, statistics, torch
sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile
from msda import eager
from msda.testing import PRESETS, make_inputs

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


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


for dtype in (torch.float32, torch.float16):
    for dist in ("uniform", "local"):
        inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", dist=dist, seed=3)
        value, shapes, starts, loc, attn = inputs.args()
        source = value.clone()
        fwd = lambda: eager.launch_forward(value, shapes, starts, loc, attn)
        variants = {
            "back to back": fwd,
            "after a 256 MB fill": lambda: (flush.zero_(), fwd()),
            "after value rewritten": lambda: (value.copy_(source), fwd()),
        }
        times = {k: [] for k in variants}
        for _ in range(3):
            for k, f in variants.items():
                times[k].append(kernel_us(f))
        print(f"decoder {dist} {str(dtype)[6:]}: " + "; ".join(
            f"{k} {min(v):.2f}-{max(v):.2f}" for k, v in times.items()), flush=True)
