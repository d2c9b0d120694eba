"""Sample parameters loaded a round ahead, and programs of several query passes: session 31, call 3.

Why: ncu's per-instruction stall sampling (call 2, `session31-call2/`) puts 12.7% of the float32
encoder `local` forward's warp samples on the placement's first use of its sample's x (long
scoreboard: the parameters' load, from DRAM: the encoder reads its locations and weights once),
31% before the turn loop in all; the decoders 2%. A one-warp program has nothing to do while
that load is out. With QUERY_PASSES a program takes several BLOCK_Q-query passes in a loop, and
with PARAMS_AHEAD each round loads the next round's parameters (the last round the next pass's
first) before its turns, so only a program's first round waits for them. Entry 60's passes
without the look-ahead lost 3-7%. Expected: the float32 encoder `local` 171 -> 155-165 us if the
parameters' wait is exposed time; the half encoders and decoders (two rounds a program) a few
percent where a round's wait is.

Profiler us of the forward kernel, median (min-max) of rounds of 20 calls, variants in turns;
each variant's output compared bit for bit with the rule's."""
import statistics
import sys

import torch

sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

VARIANT = {"passes": 1, "ahead": False}
_fwd = launch._forward_constexprs
launch._forward_constexprs = lambda *a: {
    **_fwd(*a), "QUERY_PASSES": VARIANT["passes"], "PARAMS_AHEAD": VARIANT["ahead"]
}


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


def cell(preset, dtype, dist, variants, rounds=5):
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()

    def call():
        return eager.launch_forward(value, shapes, starts, loc, attn)

    outs = {}
    for v in variants:
        VARIANT.update(passes=v[0], ahead=v[1])
        outs[v] = call()
    torch.cuda.synchronize()
    same = all(torch.equal(outs[variants[0]], outs[v]) for v in variants)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            VARIANT.update(passes=v[0], ahead=v[1])
            times[v].append(device_us(call))
    VARIANT.update(passes=1, ahead=False)
    rule = statistics.median(times[variants[0]])
    line = f"{preset} {str(dtype)[6:]} {dist}: rule {rule:.2f} ({min(times[variants[0]]):.2f}-{max(times[variants[0]]):.2f})"
    for v in variants[1:]:
        t = statistics.median(times[v])
        line += f"  {v[0]}{'a' if v[1] else ''}: {t:.2f} ({min(times[v]):.2f}-{max(times[v]):.2f}) {100 * (t / rule - 1):+.1f}%"
    print(line + f"  same {same}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, "variants: passes, a = parameters ahead", flush=True)
    RULE = (1, False)
    for dist in ("local", "uniform"):
        cell("encoder", torch.float32, dist, [RULE, (2, False), (2, True), (4, True), (8, True)], rounds=3)
    for dtype in (torch.float16, torch.bfloat16):
        cell("encoder", dtype, "local", [RULE, (1, True), (2, True), (4, True)], rounds=3)
    for dtype in (torch.float16, torch.bfloat16):
        for dist in ("uniform", "local"):
            cell("decoder", dtype, dist, [RULE, (1, True)])
    cell("encoder", torch.float16, "uniform", [RULE, (1, True), (2, True), (4, True)], rounds=3)
