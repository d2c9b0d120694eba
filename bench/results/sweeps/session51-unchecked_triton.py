"""Session 51: what a triton release other than 3.6 runs (bench/NOTES.md entry 104), timed on
3.6: no warp shuffles (launch.WARP_SHUFFLES off, so each config's own loop in place of the lane
placement) and no shared tile, against the kernels as 3.6 runs them. Profiler us of
torch.ops.msda.forward and torch.ops.msda.backward at the presets, uniform locations, the two
modes in turns in one process (2 rounds, medians). Run on the device:

    PYTHONPATH=. python3 bench/results/sweeps/session51-unchecked_triton.py
"""

from __future__ import annotations

import statistics

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import profiler_device_time
from msda.kernels import launch
from msda.testing import PRESETS, make_inputs

if not hasattr(launch, "WARP_SHUFFLES"):  # setting it would change nothing: a silent wrong sweep
    raise SystemExit("entry 104's code only (launch.WARP_SHUFFLES); since entry 105: session52-lane_gather.py")
MODES = {"3.6": (True, launch.SHARED_TILE), "unchecked": (False, False)}


def set_mode(mode: str) -> None:
    launch.WARP_SHUFFLES, launch.SHARED_TILE = MODES[mode]
    launch._forward_constexprs.cache_clear()
    launch._backward_constexprs.cache_clear()


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'preset':8s} {'dtype':9s} {'pass':8s} " + " ".join(f"{m:>10s}" for m in MODES) + "   ratio")
    for preset in ("decoder", "encoder"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            args = make_inputs(PRESETS[preset], dtype, "cuda", seed=5).args()
            B, _, M, D = args[0].shape
            grad = torch.randn(B, args[3].shape[1], M * D, device="cuda", dtype=dtype)
            calls = {
                "forward": lambda: torch.ops.msda.forward(*args),
                "backward": lambda: torch.ops.msda.backward(grad, *args),
            }
            times = {(p, m): [] for p in calls for m in MODES}
            for _ in range(2):
                for mode in MODES:
                    set_mode(mode)
                    for name, call in calls.items():
                        times[name, mode].append(profiler_device_time(call, 10, 3).median_us)
            for name in calls:
                medians = [statistics.median(times[name, m]) for m in MODES]
                print(f"{preset:8s} {str(dtype)[6:]:9s} {name:8s} " + " ".join(f"{t:10.1f}" for t in medians)
                      + f"   {medians[1] / medians[0]:.2f}x", flush=True)  # fmt: skip
    set_mode("3.6")


if __name__ == "__main__":
    main()
