"""Time the first forward + backward call of a process (Triton compiles included) for one (L, K).

    python scripts/first_call.py L K [--dtype float32] [--head-dim 32] [--encoder] [--at-launch]
        [--forward-tile Q,G,T,...]

Run it with an empty Triton cache (TRITON_CACHE_DIR pointing at a new directory) so the kernels
compile: prints the seconds of the first call (its forward and backward apart), of a second call,
and since the interpreter started.
bench/NOTES.md (entries 16 and 26) has the numbers; the bound a first call must stay under is 5 s.
300 queries by default (a decoder's rules); --encoder makes every pixel a query (an encoder's
rules, and on a Hopper GPU in float32 at head_dim 32 and 4 points the shared tile's Gluon kernel).
--at-launch leaves the backward's compiles to its launches (launch.COMPILE_AHEAD off: no compile
begun by the forward, launch.compile_backward_ahead; as before bench/NOTES.md entry 63, and entry
51 for the shared tile).
--forward-tile launches the forward at those settings instead of the rule's (the fields of
msda.kernels.launch.TileConfig, as bench.tune takes them): to weigh a candidate rule's compile time.
The host's timings move by a third between processes: alternate the candidates in one session.
"""

from __future__ import annotations

import argparse
import time

START = time.perf_counter()

import torch  # noqa: E402

import msda  # noqa: E402
from msda.testing import Shape, make_inputs  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("levels", type=int)
    parser.add_argument("points", type=int)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--encoder", action="store_true", help="every pixel a query (Q = S) instead of 300")
    parser.add_argument("--at-launch", action="store_true", help="no backward compile begun by the forward")
    parser.add_argument("--forward-tile", metavar="Q,G,T[,...]", help="TileConfig fields for the forward")
    opts = parser.parse_args()
    if opts.forward_tile:
        from msda.kernels import launch

        tile = launch.TileConfig(*(int(n) for n in opts.forward_tile.split(",")))
        launch.forward_config = lambda *args: tile
    if opts.at_launch:
        from msda.kernels import launch

        launch.COMPILE_AHEAD = False
    sizes = [(64, 64), (32, 32), (16, 16), (8, 8), (4, 4), (2, 2), (1, 1), (1, 1)]
    levels = tuple(sizes[: opts.levels])
    queries = sum(h * w for h, w in levels) if opts.encoder else 300
    shape = Shape(batch=2, queries=queries, heads=8, head_dim=opts.head_dim, levels=levels, points=opts.points)
    inputs = make_inputs(shape, DTYPES[opts.dtype], "cuda", requires_grad=True)
    torch.cuda.synchronize()
    times = []  # (forward, backward) seconds of each call
    for _ in range(2):
        start = time.perf_counter()
        out = msda.multi_scale_deformable_attention(*inputs.args())
        torch.cuda.synchronize()
        middle = time.perf_counter()
        out.float().sum().backward()
        torch.cuda.synchronize()
        times.append((middle - start, time.perf_counter() - middle))
    (forward, backward), second = times[0], sum(times[1])
    rule = (opts.forward_tile or "rule") + " at-launch" * opts.at_launch
    print(f"L={opts.levels} K={opts.points} {opts.dtype} Q={queries} {rule}: "
          f"first forward+backward {forward + backward:.2f} s (forward {forward:.2f}, backward {backward:.2f}), "
          f"second {second * 1e3:.1f} ms, since start {time.perf_counter() - START:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
