"""Where the backward's device time goes, kernel by kernel, in the default and deterministic modes.

    python -m bench.phases [--presets decoder encoder] [--dtypes float32 float16 bfloat16]
                           [--dists uniform] [--calls 10] [--each]

For each cell: `torch.ops.msda.backward` called a few times to warm up, then `--calls` times under
torch.profiler; each CUDA kernel's device time per call, summed by name, largest first, and the
total (the bench's profiler column measures the same total), with
torch.use_deterministic_algorithms off and on. The deterministic mode's kernels
(kernels/deterministic.py) and PyTorch's small ones around them (the counters' zeroing, the
cumulative sum) show up by name. --each lists every launch of a call instead, in launch order
(the median over the calls): the lists kernel's count and fill passes apart. bench/NOTES.md
entries 37 and 38 read these.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import msda  # noqa: F401  (registers torch.ops.msda)
from msda.testing import PRESETS, make_inputs

from .timing import warm_up
from .variants import DISTS, DTYPES


def kernel_times(call, calls: int, each: bool = False) -> list[tuple[str, float]]:
    """Device time per call (us) of each CUDA kernel `call` launches: by kernel name, largest
    first; each: every launch of a call in launch order, the median over the calls."""
    warm_up(call)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return per_launch(kernels, calls) if each else by_name(kernels, calls)


def by_name(kernels: list[tuple[str, float]], calls: int) -> list[tuple[str, float]]:
    """(name, us a call) of the (name, us) launches of `calls` calls, summed by name, largest first."""
    times: dict[str, float] = defaultdict(float)
    for name, us in kernels:
        times[name] += us / calls
    return sorted(times.items(), key=lambda item: -item[1])


def per_launch(kernels: list[tuple[str, float]], calls: int) -> list[tuple[str, float]]:
    """(name, us) of each launch of a call, in order, the median over `calls` calls that each
    made the same launches."""
    launches = len(kernels) // calls
    names = [name for name, _ in kernels[:launches]]
    if launches * calls != len(kernels) or any(kernels[i][0] != names[i % launches] for i in range(len(kernels))):
        raise RuntimeError(f"{len(kernels)} kernels in {calls} calls: not the same launches each call")
    return [(names[i], statistics.median(kernels[i + k * launches][1] for k in range(calls))) for i in range(launches)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["decoder", "encoder"], choices=sorted(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--dists", nargs="+", default=["uniform"], choices=DISTS)
    parser.add_argument("--calls", type=int, default=10, help="profiled calls a cell and mode")
    parser.add_argument("--smallest", type=float, default=0.5, help="hide kernels under this many us a call")
    parser.add_argument("--each", action="store_true", help="every launch of a call, in order, not sums by name")
    opts = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (profiler device time, us a call)")
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        for preset in opts.presets:
            for dist in opts.dists:
                for dtype_name in opts.dtypes:
                    _print_cell(PRESETS[preset], preset, dist, dtype_name, opts)
                    torch.cuda.empty_cache()
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _print_cell(shape, preset: str, dist: str, dtype_name: str, opts) -> None:
    """One cell's backward kernels, by the default and the deterministic mode."""
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=3)
    grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda").to(dtype)
    for mode in ("default", "deterministic"):
        torch.use_deterministic_algorithms(mode == "deterministic")
        times = kernel_times(lambda: torch.ops.msda.backward(grad, *inputs.args()), opts.calls, opts.each)
        print(f"== {preset} {dist} {dtype_name} {mode}: {sum(us for _, us in times):.1f}", flush=True)
        for name, us in times:
            if us >= opts.smallest:
                print(f"   {us:8.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
