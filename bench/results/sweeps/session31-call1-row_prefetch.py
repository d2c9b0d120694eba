"""The forward's corner rows prefetched into L1 turns ahead (ROW_PREFETCH): session 31, call 1.

Why: the float32 decoder forward is latency-bound (entry 60's ncu: L2 49% busy, 15 warps
waiting on memory for each issuing) and keeps at most 5 rows in flight a thread at 40
registers; registers cap what more a thread can hold. In the lane placement, lane j places the
sample that turn j reads: at turn k the lanes k + A can ask the L1 for their own four rows
(PTX prefetch.global.L1, SASS CCTL.E.PF1, predicated per corner), rows in flight that hold no
register. Expected: the float32 decoder 8.8 -> 7.5-8.0 us if round trips bound it; a loss where
the L1 is the busy unit (the encoder `local`, 71%) or if the prefetches' tag lookups cost more
than the misses they spare.

Profiler us a call (the forward kernel), 5 rounds with the variants in turns, 20 calls a round;
each variant's output compared bit for bit with the rule's."""
import statistics
import sys

import torch

sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

AHEAD = {"turns": 0}
_fwd = launch._forward_constexprs
launch._forward_constexprs = lambda *a: {**_fwd(*a), "ROW_PREFETCH": AHEAD["turns"]}
VARIANTS = (0, 1, 2)


def device_us(fn, calls=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in ev) / calls


def cell(preset, dtype, dist, rounds=5):
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()

    def call():
        return eager.launch_forward(value, shapes, starts, loc, attn)

    outs = {}
    for a in VARIANTS:
        AHEAD["turns"] = a
        outs[a] = call()
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], outs[a]) for a in VARIANTS)
    times = {a: [] for a in VARIANTS}
    for _ in range(rounds):
        for a in VARIANTS:
            AHEAD["turns"] = a
            times[a].append(device_us(call))
    AHEAD["turns"] = 0
    rule = statistics.median(times[0])
    line = f"{preset} {str(dtype)[6:]} {dist}: rule {rule:.2f} ({min(times[0]):.2f}-{max(times[0]):.2f})"
    for a in VARIANTS[1:]:
        t = statistics.median(times[a])
        line += f"  ahead {a}: {t:.2f} ({min(times[a]):.2f}-{max(times[a]):.2f}) {100 * (t / rule - 1):+.1f}%"
    print(line + f"  same {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dist in ("uniform", "local"):
            cell("decoder", dtype, dist)
    for dist in ("local", "uniform"):
        cell("encoder", torch.float32, dist, rounds=3)
    cell("encoder", torch.float16, "local", rounds=3)
