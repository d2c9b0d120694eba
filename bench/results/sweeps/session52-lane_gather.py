"""Session 52: the lane placement with its placements passed by `tl.gather` along a lane axis
that each triton release lays over consecutive lanes (launch.LANE_AXES, bench/NOTES.md entry
105), against each config's own loop (launch.LANE_AXIS None: what an unlisted release runs).
Profiler us of torch.ops.msda.forward and torch.ops.msda.backward at the presets, uniform
locations, the modes in turns in one process (2 rounds, medians). Run on the device, with this
checkout's msda or another's first on the path (the inline-asm shuffles of entry 104's code,
whose flag was launch.WARP_SHUFFLES):

    PYTHONPATH=. python3 bench/results/sweeps/session52-lane_gather.py
"""

from __future__ import annotations

import statistics

import torch
import triton

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import profiler_device_time
from msda.kernels import launch
from msda.testing import PRESETS, make_inputs

SHARED_TILE = launch.SHARED_TILE
if hasattr(launch, "LANE_AXIS"):
    MODES = {"lane": launch.LANE_AXIS, "own loop": None}
else:  # entry 104's code
    MODES = {"lane": True, "own loop": False}


def set_mode(mode: str) -> None:
    if hasattr(launch, "LANE_AXIS"):
        launch.LANE_AXIS = MODES[mode]
    else:
        launch.WARP_SHUFFLES = MODES[mode]
    launch.SHARED_TILE = SHARED_TILE if mode == "lane" else False
    launch._forward_constexprs.cache_clear()
    launch._backward_constexprs.cache_clear()


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, msda.__file__,
          "modes", MODES, "shared tile", SHARED_TILE)  # fmt: skip
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
    set_mode("lane")


if __name__ == "__main__":
    main()
