"""Sweep the kernels' launch heuristics at the presets of docs/benchmarking.md.

    python -m bench.tune [--presets decoder encoder] [--dtypes float32 float16 bfloat16]
                         [--kernels fwd bwd] [--forward 2048,4,1 1024,2,1 ...] [--backward 1024,4 ...]

Device time by CUDA-graph replay of the operator calls (uniform locations), one line per
(kernel, preset, dtype, variant), and the peer deformops beside it when importable. Used to
choose the FORWARD_*/BACKWARD_* constants in msda/kernels; bench/NOTES.md logs the choices.
"""

from __future__ import annotations

import argparse

import torch

import msda
from msda.kernels import backward as backward_kernel
from msda.kernels import forward as forward_kernel
from msda.testing import PRESETS, make_inputs

from .timing import graph_device_time, profiler_device_time
from .variants import DTYPES, Unavailable, deformops_msda

# Forward: (bytes of value rows per corner per step, warps, samples per step); backward:
# (elements, warps). 2048 bytes at 4 warps is one 16-byte load per thread.
FORWARD_SWEEP = [
    (2048, 4, 1),
    (1024, 4, 1),
    (4096, 4, 1),
    (1024, 2, 1),
    (2048, 2, 1),
    (4096, 8, 1),
    (4096, 4, 2),
    (16384, 4, 16),
]
BACKWARD_SWEEP = [(1024, 4), (1024, 2), (2048, 4)]


def _configure_forward(tile_bytes: int, warps: int, max_block_lk: int) -> None:
    forward_kernel.FORWARD_TILE_BYTES = tile_bytes
    forward_kernel.FORWARD_NUM_WARPS = warps
    forward_kernel.FORWARD_MAX_BLOCK_LK = max_block_lk


def _configure_backward(tile: int, warps: int) -> None:
    backward_kernel.BACKWARD_TILE_ELEMENTS = tile
    backward_kernel.BACKWARD_NUM_WARPS = warps


def _autograd_backward(forward, args, grad):
    value, shapes, starts, loc, attn = (a.detach().requires_grad_(a.is_floating_point()) for a in args)
    out = forward(value, shapes, starts, loc, attn)
    return lambda: torch.autograd.grad(out, (value, loc, attn), grad, retain_graph=True)


def _comma_ints(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def _deformops():
    try:
        return deformops_msda(), ""
    except Unavailable as e:
        return None, str(e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["decoder", "encoder"], choices=sorted(PRESETS))
    parser.add_argument("--kernels", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--forward",
        nargs="+",
        type=_comma_ints,
        default=FORWARD_SWEEP,
        metavar="BYTES,WARPS,SAMPLES",
        help="forward variants to time (default: FORWARD_SWEEP)",
    )
    parser.add_argument(
        "--backward",
        nargs="+",
        type=_comma_ints,
        default=BACKWARD_SWEEP,
        metavar="ELEMENTS,WARPS",
        help="backward variants to time (default: BACKWARD_SWEEP)",
    )
    opts = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    peer, why = _deformops()
    if peer is None:
        print(why)
    for preset in opts.presets:
        for dtype_name in opts.dtypes:
            args = make_inputs(PRESETS[preset], DTYPES[dtype_name], "cuda", seed=0).args()
            grad = torch.randn_like(torch.ops.msda.forward(*args))
            cell = f"{preset:8s} {dtype_name:9s}"
            for variant in opts.forward if "fwd" in opts.kernels else []:
                _configure_forward(*variant)
                run = lambda: torch.ops.msda.forward(*args)  # noqa: E731
                # Both timers: the floor is judged on the profiler's number.
                print(f"fwd {cell} {variant}  graph {graph_device_time(run)}  profiler {profiler_device_time(run)}")
            for variant in opts.backward if "bwd" in opts.kernels else []:
                _configure_backward(*variant)
                t = graph_device_time(lambda: torch.ops.msda.backward(grad, *args), calls=10, replays=5)
                print(f"bwd {cell} {variant}  {t}")
            backward = "bwd" in opts.kernels
            if backward:
                _configure_backward(*opts.backward[0])
                # The profiler, not graph replay: autograd's backward waits on the stream its
                # forward ran on, which a capture on a side stream may not depend on.
                t = profiler_device_time(_autograd_backward(msda.multi_scale_deformable_attention, args, grad), 10, 3)
                print(f"bwd {cell} msda autograd.grad (profiler) {t}")
            if peer is not None:
                try:
                    print(f"fwd {cell} deformops {graph_device_time(lambda: peer(*args))}")
                    if backward:
                        t = profiler_device_time(_autograd_backward(peer, args, grad), 10, 3)
                        print(f"bwd {cell} deformops autograd.grad (profiler) {t}")
                except Exception as e:  # a peer's failure is a line, not a crash
                    print(f"deformops failed: {type(e).__name__}: {e}")
            del args, grad
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
