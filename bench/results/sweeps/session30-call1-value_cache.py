"""The value gathers with the `.cg` cache modifier (L2 only, no L1 line allocated): session 30, call 1.

Why: the float32 decoder forward hits L1 on 13.8% of its corner rows (entry 60's ncu) and waits
on memory; a miss costs its L1 a tag wavefront and a fill. `ld.global.cg` skips the L1 allocation:
fewer L1 wavefronts and possibly a shorter round trip, for the few hits lost (16% more L2
sectors). Expected: the decoder forward -2 to -5% or a loss of the same size; the encoders
(L1 hits 32-44%) slower. The backward's value gathers at the decoders likewise (evict-first kept).
Never tried (bench/NOTES.md has no cache modifier on a load).

Profiler us a call (every kernel of the call, the fill included), 5 rounds with the variants in
turns, 20 calls a round; outputs compared with the rule's."""
import statistics
import sys

import torch

sys.path.insert(0, ".")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

CACHE = {"forward": "", "backward": ""}
_fwd, _bwd = launch._forward_constexprs, launch._backward_constexprs
launch._forward_constexprs = lambda *a: {**_fwd(*a), "VALUE_CACHE": CACHE["forward"]}
# ptxas takes no L1 eviction hint on a load that skips L1: `.cg` goes without evict-first.
launch._backward_constexprs = lambda *a: {
    **_bwd(*a), "VALUE_CACHE": CACHE["backward"], **({"VALUE_EVICTION": ""} if CACHE["backward"] else {})
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


def cell(preset, dtype, dist, direction, rounds=5):
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    B, _, M, D = value.shape
    grad = torch.randn(B, loc.shape[1], M * D, device="cuda", dtype=dtype)

    def call():
        if direction == "forward":
            return eager.launch_forward(value, shapes, starts, loc, attn)
        return eager.launch_backward(grad, value, shapes, starts, loc, attn)

    results = {}
    for cache in ("", ".cg"):
        CACHE[direction] = cache
        results[cache] = call()
    torch.cuda.synchronize()
    if direction == "forward":
        same = torch.equal(results[""], results[".cg"])
    else:
        (gv0, gl0, ga0), (gv1, gl1, ga1) = results[""], results[".cg"]
        same = torch.equal(gl0, gl1) and torch.equal(ga0, ga1) and torch.allclose(gv0, gv1, rtol=1e-3, atol=1e-5)
    times = {"": [], ".cg": []}
    for _ in range(rounds):
        for cache in times:
            CACHE[direction] = cache
            times[cache].append(device_us(call))
    CACHE[direction] = ""
    a, b = statistics.median(times[""]), statistics.median(times[".cg"])
    print(f"{preset} {direction} {str(dtype)[6:]} {dist}: rule {a:.2f} ({min(times['']):.2f}-{max(times['']):.2f})"
          f"  .cg {b:.2f} ({min(times['.cg']):.2f}-{max(times['.cg']):.2f})  {100 * (b / a - 1):+.1f}%  same {same}",
          flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    # Call 1 ran the forward's decoder cells, then stopped at the first backward (`.cg` with
    # evict-first does not assemble); call 2 runs the backward's.
    directions = sys.argv[1:] or ["forward", "backward"]
    for direction in directions:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for dist in ("uniform", "local"):
                cell("decoder", dtype, dist, direction)
    if "forward" not in directions:
        sys.exit()
    for dist in ("local", "uniform"):
        cell("encoder", torch.float32, dist, "forward", rounds=3)
    cell("encoder", torch.float16, "local", "forward", rounds=3)
