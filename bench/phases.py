"""Where the backward's device time goes, kernel by kernel, in the default and deterministic modes.

    python -m bench.phases [--presets decoder encoder] [--dtypes float32 float16 bfloat16]
                           [--dists uniform] [--calls 10]

For each cell: `torch.ops.msda.backward` called a few times to warm up, then `--calls` times under
torch.profiler; each CUDA kernel's device time per call, summed by name, largest first, and the
total (the bench's profiler column measures the same total), with
torch.use_deterministic_algorithms off and on. The deterministic mode's kernels
(kernels/deterministic.py) and PyTorch's small ones around them (the counters' zeroing, the
cumulative sum, the fixed-point scale) show up by name. bench/NOTES.md entry 37 read these.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import msda  # noqa: F401  (registers torch.ops.msda)
from msda.testing import PRESETS, make_inputs

from .timing import warm_up
from .variants import DISTS, DTYPES


def kernel_times(call, calls: int) -> dict[str, float]:
    """Device time per call (us) of each CUDA kernel `call` launches, by kernel name."""
    warm_up(call)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / calls
    return dict(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["decoder", "encoder"], choices=sorted(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--dists", nargs="+", default=["uniform"], choices=DISTS)
    parser.add_argument("--calls", type=int, default=10, help="profiled calls a cell and mode")
    parser.add_argument("--smallest", type=float, default=0.5, help="hide kernels under this many us a call")
    opts = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (profiler device time, us a call)")
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        for preset in opts.presets:
            shape = PRESETS[preset]
            for dist in opts.dists:
                for dtype_name in opts.dtypes:
                    dtype = DTYPES[dtype_name]
                    inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=3)
                    grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda")
                    grad = grad.to(dtype)
                    for mode in ("default", "deterministic"):
                        torch.use_deterministic_algorithms(mode == "deterministic")
                        times = kernel_times(lambda: torch.ops.msda.backward(grad, *inputs.args()), opts.calls)
                        print(f"== {preset} {dist} {dtype_name} {mode}: {sum(times.values()):.1f}", flush=True)
                        for name, us in sorted(times.items(), key=lambda item: -item[1]):
                            if us >= opts.smallest:
                                print(f"   {us:8.1f}  {name[:100]}")
                    del inputs, grad
                    torch.cuda.empty_cache()
    finally:
        torch.use_deterministic_algorithms(deterministic)


if __name__ == "__main__":
    main()
