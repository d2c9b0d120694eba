"""Launch the Triton forward and backward kernels on edge shapes, for compute-sanitizer (each call
both ways: msda::forward/backward, and the softmax operators msda::forward_softmax/backward_softmax
with the weights read as logits; on CUDA the eager fast path's softmax backward too, whose scratch
is grad_logits itself in float32):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize.py [--large]
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py --shared-tile-only

The shapes are the edge cases of msda.testing_cases (1x1, 1x200 and 200x1 levels, D = 24
and 256, NaN / +-inf / far-outside locations, non-contiguous arguments, an expanded grad_output,
int32 shapes; the empty calls launch nothing) in every value dtype, plus the bad inputs that only
a CPU eager call can reject (S != sum(H * W), empty or negative levels, inconsistent
level_start_index): on CUDA they run, and every access must stay inside its tensor. --large adds
a value of more than 2**31 elements (4 GiB), sampled near its end (the 64-bit index path).
On a Hopper GPU the float32 encoder-shaped calls of `shared_tile_calls` run the shared-memory
tile's kernel (msda/kernels/shared_tile.py), the one kernel whose shared memory is addressed by
hand: `--shared-tile-only` runs just those, for racecheck.

Prints one summary line. memcheck reports the kernels' errors; a Python error exits nonzero.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: msda

from msda import eager, ops  # noqa: E402
from msda.testing import Shape, make_inputs  # noqa: E402
from msda.testing_cases import BAD_CALLS, EDGE_CASES, FORWARD_ARGS, valid_args  # noqa: E402
from msda.validation import FLOAT_DTYPES as DTYPES  # noqa: E402  (every value dtype)


def forward_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output):
    """One forward and one backward launch through the registered operators, then through their
    softmax forms (the weights as logits), then (CUDA) through the eager fast path's softmax form."""
    args = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    torch.ops.msda.forward(*args)
    torch.ops.msda.backward(grad_output, *args)
    torch.ops.msda.forward_softmax(*args)
    torch.ops.msda.backward_softmax(grad_output, *args)
    if value.is_cuda and grad_output.numel() > 0:
        eager.launch_forward(*args, softmax=True)
        eager.launch_backward(grad_output, *args, softmax=True)


def large_call(device: torch.device) -> tuple[torch.Tensor, ...]:
    """bfloat16 value (2, S, 2, 32), S = 2048 * 8192 + 37 * 53 (2**31 + 251,008 elements), every
    sample near the far corner of its level (x, y in [0.99, 1.01))."""
    levels = ((2048, 8192), (37, 53))
    S = sum(h * w for h, w in levels)
    value = torch.zeros(2, S, 2, 32, dtype=torch.bfloat16, device=device)
    shapes = torch.tensor(levels, device=device)
    starts = torch.tensor([0, levels[0][0] * levels[0][1]], device=device)
    loc = 0.99 + 0.02 * torch.rand(2, 64, 2, 2, 4, 2, device=device)
    attn = torch.rand(2, 64, 2, 2, 4, device=device)
    grad_output = torch.randn(2, 64, 64, device=device, dtype=torch.bfloat16)
    return value, shapes, starts, loc, attn, grad_output


def shared_tile_calls(device: torch.device, sync) -> int:
    """Float32 encoder-shaped calls (every pixel a query, head_dim 32, 4 points) with last levels
    of launch.SHARED_TILE_PIXELS pixels (the tile's), one past it (the backward kernel's) and a
    small one, a quarter of the samples outside: through the operators, then through the eager
    fast path without level starts and with an expanded grad_output. Returns the calls made: none
    off CUDA, where nothing takes the tile (and the interpreter would take minutes)."""
    calls = 0
    if device.type != "cuda":
        return calls
    for seed, levels in enumerate((((24, 30), (3, 4)), ((8, 142), (4, 71)), ((10, 114), (5, 57)))):
        S = sum(h * w for h, w in levels)
        shape = Shape(batch=2, queries=S, heads=2, head_dim=32, levels=levels, points=4)
        value, shapes, starts, loc, attn = make_inputs(
            shape, torch.float32, device, outside_fraction=0.25, seed=seed
        ).args()
        torch.ops.msda.forward(value, shapes, starts, loc, attn)
        torch.ops.msda.backward(torch.randn(2, S, 64, device=device), value, shapes, starts, loc, attn)
        eager.launch_forward(value, shapes, None, loc, attn)
        expanded = torch.randn(2, 1, 64, device=device).expand(2, S, 64)
        eager.launch_backward(expanded, value, shapes, None, loc, attn)
        sync()
        calls += 1
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="add a value of more than 2**31 elements (4 GiB)")
    # A dry run of this script without a GPU: --device cpu with TRITON_INTERPRET=1 MSDA_BACKEND=triton.
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shared-tile-only", action="store_true", help="only the calls of shared_tile_calls")
    args = parser.parse_args()
    device = torch.device(args.device)
    assert ops.uses_triton(device), f"{device} tensors must run the Triton kernels (is MSDA_BACKEND=torch set?)"
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    tile_calls = shared_tile_calls(device, sync)
    launched, empty = tile_calls, 0
    for case in [] if args.shared_tile_only else EDGE_CASES:
        for dtype in DTYPES:
            inputs, grad_output = case.build(dtype, device)
            forward_backward(*inputs.args(), grad_output)
            sync()
            if case.shape.batch * case.shape.queries == 0:
                empty += 1  # the operators launch nothing for an empty call
            else:
                launched += 1
    # On CPU these are rejected by the eager data checks: nothing to launch.
    every_case = device.type == "cuda" and not args.shared_tile_only
    unchecked = [case for case in BAD_CALLS if case.needs_data] if every_case else []
    for case in unchecked:
        edited = case.edit(valid_args(device))
        forward_backward(*(edited[name] for name in (*FORWARD_ARGS, "grad_output")))
        sync()
        launched += 1
    if args.large:
        forward_backward(*large_call(device))
        sync()
        launched += 1

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(
        f"sanitize: {launched} forward+backward calls launched on {name} ({tile_calls} shared-tile "
        f"shapes; {0 if args.shared_tile_only else len(EDGE_CASES)} edge cases x {len(DTYPES)} dtypes and "
        f"{len(unchecked)} unchecked bad inputs, each plain and softmax"
        f"{', 1 value > 2**31 elements' if args.large else ''}; {empty} empty calls launch nothing)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
