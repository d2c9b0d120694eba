"""Session 42: msda against deformops 3.0.1 at the shapes of models other than the two presets
(profiler device time a call, us; `local` locations; forward and backward). Run on the device:

    PYTHONPATH=.:/tmp/site python3 bench/results/sweeps/session42-model_shapes.py

Every shape has 8 heads unless said; levels are (H, W) pairs.
"""

from __future__ import annotations

import sys
import time

import torch

import msda  # noqa: F401  (registers torch.ops.msda.*)
from bench.timing import profiler_device_time
from bench.variants import deformops_msda
from msda.testing import DETR_LEVELS, Shape, make_inputs

RT_DETR_LEVELS = ((80, 80), (40, 40), (20, 20))  # 640 x 640, strides 8, 16, 32
MASK2FORMER_LEVELS = ((16, 16), (32, 32), (64, 64))  # 512 x 512, strides 32, 16, 8 (its order)
BEVFORMER_CAMERA_LEVELS = ((116, 200), (58, 100), (29, 50), (15, 25))  # 928 x 1600, strides 8-64
SHAPES = {
    "DINO decoder (Q=900)": Shape(batch=4, queries=900, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    "RT-DETR decoder, B=4": Shape(batch=4, queries=300, heads=8, head_dim=32, levels=RT_DETR_LEVELS, points=4),
    "RT-DETR decoder, B=1": Shape(batch=1, queries=300, heads=8, head_dim=32, levels=RT_DETR_LEVELS, points=4),
    "Mask2Former pixel decoder, B=8": Shape(batch=8, queries=5376, heads=8, head_dim=32, levels=MASK2FORMER_LEVELS, points=4),
    "BEVFormer temporal self-attn": Shape(batch=2, queries=40000, heads=8, head_dim=32, levels=((200, 200),), points=4),
    "BEVFormer spatial cross-attn": Shape(batch=6, queries=3000, heads=8, head_dim=32, levels=BEVFORMER_CAMERA_LEVELS, points=8),
    "decoder, 4 heads of 64": Shape(batch=4, queries=300, heads=4, head_dim=64, levels=DETR_LEVELS, points=4),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cell(shape: Shape, dtype: torch.dtype, peer) -> dict:
    inputs = make_inputs(shape, dtype, "cuda", dist="local", seed=1)
    args = inputs.args()
    B, Q, M, D = shape.batch, shape.queries, shape.heads, shape.head_dim
    grad = torch.randn(B, Q, M * D, device="cuda", dtype=dtype)
    times = {}
    times["msda fwd"] = profiler_device_time(lambda: torch.ops.msda.forward(*args), 10, 3).median_us
    times["msda bwd"] = profiler_device_time(lambda: torch.ops.msda.backward(grad, *args), 10, 3).median_us
    value, shapes, starts, loc, attn = (t.detach().clone() for t in args)
    leaves = [t.requires_grad_() for t in (value, loc, attn)]
    out = peer(value, shapes, starts, loc, attn)
    times["deformops fwd"] = profiler_device_time(lambda: peer(value, shapes, starts, loc, attn), 10, 3).median_us
    times["deformops bwd"] = profiler_device_time(
        lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), 10, 3
    ).median_us
    return times


def main() -> int:
    peer = deformops_msda()
    names = sys.argv[1:] or list(SHAPES)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'shape':34} {'dtype':9} {'msda fwd':>9} {'deformops':>9} {'x':>5}   {'msda bwd':>9} {'deformops':>9} {'x':>5}")
    for name in names:
        for dname, dtype in DTYPES.items():
            t0 = time.perf_counter()
            try:
                t = cell(SHAPES[name], dtype, peer)
            except Exception as e:  # noqa: BLE001  (a row saying why, the sweep goes on)
                print(f"{name:34} {dname:9} error: {type(e).__name__}: {str(e)[:120]}")
                continue
            f, df, b, db = t["msda fwd"], t["deformops fwd"], t["msda bwd"], t["deformops bwd"]
            print(
                f"{name:34} {dname:9} {f:9.1f} {df:9.1f} {df / f:5.2f}   {b:9.1f} {db:9.1f} {db / b:5.2f}"
                f"   ({time.perf_counter() - t0:.0f} s)", flush=True,
            )
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
