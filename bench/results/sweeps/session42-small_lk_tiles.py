"""Session 42: the encoder rules' programs at shapes with few samples a query (L * K < 16), where
one-warp forward programs of 2 queries (4 in half precision) and backward programs of 1 query
(2) make so many programs that the block scheduler's rate bounds the kernel (the BEVFormer
temporal self-attention shape, L * K = 4: 320,000 forward programs, ~0.6 ns each, entry 87).
Each tile is the rule's own with `block_q` changed (launch.forward_config / backward_config
replaced for the call); profiler device time a call, us; outputs checked against the rule's.

    PYTHONPATH=. python3 bench/results/sweeps/session42-small_lk_tiles.py
"""

from __future__ import annotations

import sys

import torch

import msda  # noqa: F401
from bench.timing import profiler_device_time
from msda.kernels import launch
from msda.testing import Shape, make_inputs

SHAPES = {
    "TSA L1K4 B2 200x200": Shape(batch=2, queries=40000, heads=8, head_dim=32, levels=((200, 200),), points=4),
    "L2K4 B2 100x100": Shape(batch=2, queries=12500, heads=8, head_dim=32, levels=((100, 100), (50, 50)), points=4),
    "M2F L3K4 B8": Shape(batch=8, queries=5376, heads=8, head_dim=32, levels=((16, 16), (32, 32), (64, 64)), points=4),
}
RUNS = [("TSA L1K4 B2 200x200", torch.float32), ("TSA L1K4 B2 200x200", torch.bfloat16),
        ("TSA L1K4 B2 200x200", torch.float16), ("L2K4 B2 100x100", torch.float32),
        ("L2K4 B2 100x100", torch.bfloat16), ("M2F L3K4 B8", torch.float32), ("M2F L3K4 B8", torch.bfloat16)]
FORWARD_RULE, BACKWARD_RULE = launch.forward_config, launch.backward_config


def timed(fn) -> float:
    return profiler_device_time(fn, 10, 3).median_us


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for name, dtype in RUNS:
        shape = SHAPES[name]
        L, K, D = len(shape.levels), shape.points, shape.head_dim
        args = make_inputs(shape, dtype, "cuda", dist="local", seed=1).args()
        grad = torch.randn(shape.batch, shape.queries, shape.heads * D, device="cuda", dtype=dtype)
        rule_fwd, rule_bwd = FORWARD_RULE(L, K, D, dtype, True), BACKWARD_RULE(L, K, D, dtype, True)
        ref_out = torch.ops.msda.forward(*args)
        ref_grads = torch.ops.msda.backward(grad, *args)
        line = []
        for q in sorted({rule_fwd.block_q, *(rule_fwd.block_q * m for m in (2, 4, 8))}):
            tile = rule_fwd._replace(block_q=q)
            launch.forward_config = lambda *a, tile=tile, **k: tile
            try:
                out = torch.ops.msda.forward(*args)
                diff = (out.float() - ref_out.float()).abs().max().item()
                line.append(f"fwd q{q}: {timed(lambda: torch.ops.msda.forward(*args)):.1f} (diff {diff:.1e})")
            finally:
                launch.forward_config = FORWARD_RULE
        print(f"{name} {str(dtype)[6:]}: " + "; ".join(line), flush=True)
        line = []
        for q in sorted({rule_bwd.block_q, *(rule_bwd.block_q * m for m in (2, 4, 8))}):
            tile = rule_bwd._replace(block_q=q)
            launch.backward_config = lambda *a, tile=tile, **k: BACKWARD_RULE(*a, **k) if k.get("lists") else tile
            try:
                grads = torch.ops.msda.backward(grad, *args)
                diff = max((g.float() - r.float()).abs().max().item() / (r.float().abs().max().item() or 1)
                           for g, r in zip(grads, ref_grads))
                line.append(f"bwd q{q}: {timed(lambda: torch.ops.msda.backward(grad, *args)):.1f} (rel {diff:.1e})")
            finally:
                launch.backward_config = BACKWARD_RULE
        print(f"{name} {str(dtype)[6:]}: " + "; ".join(line), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
