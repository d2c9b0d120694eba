"""What an eager call costs on the host, next to the floors PyTorch sets (issue 14's table).

    python -m bench.calls [--preset decoder] [--dtype float32] [--calls 300] [--rounds 7] [--chain 6]

On a GPU, each row is timed as docs/benchmarking.md's end-to-end time: `--calls` calls enqueued
back to back (a third as many for the rows with a backward), one synchronize, divided; the rows
take turns, round after round, and the table shows the median and the range over `--rounds`.
"device us" is the row's device time per call by torch.profiler (bench.timing), so that a row
whose host time falls to its device time reads as device-bound.

The floors: an empty in-place add (any eager op), a trivial autograd step, and `noop-function`,
an autograd.Function with the operator's signature whose forward allocates the output and whose
backward allocates the three gradients, with no kernel: what any Python autograd Function costs
through the engine (`torch.autograd.grad`), before its kernels. `--chain N`: N calls of the
operator, then one backward for all of them, per call, as in a model whose backward covers every
layer: the engine's fixed cost a backward shared among the calls. The extension-module drop-in
is timed inside the autograd.Function of Deformable DETR's models/ops that calls it, beside the
same Function on torch.ops.msda.*. deformops is timed where it is importable. bench/NOTES.md
entries 15, 40, 42 and 85 read these.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.autograd.function import once_differentiable

import msda
from csrc_free_ops import extension
from msda import eager
from msda.testing import PRESETS, Shape, make_inputs

from .timing import end_to_end_time, profiler_device_time
from .variants import DTYPES, Unavailable, deformops_msda


class _NoopFunction(torch.autograd.Function):
    """The operator's signature through autograd, allocating its results, launching nothing."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        B, _, M, D = value.shape
        return value.new_empty((B, sampling_locations.shape[1], M * D))

    @staticmethod
    def backward(ctx, grad_output):
        value, loc, attn = ctx.saved_tensors
        return torch.empty_like(value), None, None, torch.empty_like(loc), torch.empty_like(attn)


def _extension_function(forward, backward):
    """The autograd.Function of Deformable DETR's models/ops, around an extension's
    `forward(value, shapes, starts, loc, attn)` and `backward(value, ..., attn, grad_output)`."""

    class ExtensionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
            return forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_output):
            grad_value, grad_loc, grad_attn = backward(*ctx.saved_tensors, grad_output)
            return grad_value, None, None, grad_loc, grad_attn

    return ExtensionFunction.apply


# The extension-module drop-in (csrc_free_ops.extension) in that Function, and the same Function
# on the registered operator (what the drop-in cost before it took the eager fast paths).
_DROP_IN_FUNCTION = _extension_function(extension.ms_deform_attn_forward, extension.ms_deform_attn_backward)
_OPERATOR_FUNCTION = _extension_function(
    torch.ops.msda.forward,
    lambda value, shapes, starts, loc, attn, grad_output: torch.ops.msda.backward(
        grad_output, value, shapes, starts, loc, attn
    ),
)


def rows(shape: Shape, dtype: torch.dtype, chain: int, device: str = "cuda") -> dict:
    """name -> (call, whether it runs a backward) at `shape` (the direct kernel launch on CUDA only)."""
    inputs = make_inputs(shape, dtype, device, dist="uniform", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device=device, dtype=dtype)
    tiny = torch.zeros(1, device=device)
    x = torch.zeros(1, device=device, requires_grad=True)
    f = msda.multi_scale_deformable_attention

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()

        return call

    def step(op, level_starts=starts):
        value_leaf, loc_leaf, attn_leaf = leaves
        return lambda: torch.autograd.grad(op(value_leaf, shapes, level_starts, loc_leaf, attn_leaf), leaves, grad)

    # Each of the chain's calls has leaves of its own, as a model's layers do: one value shared by
    # them all would time the engine summing its gradients (a 91 MB add a call at the decoder).
    layers = [[t.detach().clone().requires_grad_() for t in leaves] for _ in range(chain)]

    def chained(op):
        def call():
            total = sum(op(v, shapes, starts, l, a) for v, l, a in layers)
            return torch.autograd.grad(total, [t for layer in layers for t in layer], grad)

        return call

    table = {
        "empty in-place add (any eager op)": (lambda: tiny.add_(1), False),
        "trivial autograd step, (x * 2) grad": (lambda: torch.autograd.grad(x * 2, x, tiny), True),
        "noop-function: forward, no grad": (
            no_grad(lambda: _NoopFunction.apply(value, shapes, starts, loc, attn)), False
        ),
        "noop-function: forward + backward": (step(_NoopFunction.apply), True),
        "msda functional forward, no grad": (no_grad(lambda: f(value, shapes, starts, loc, attn)), False),
        "  no grad, level_start_index=None": (no_grad(lambda: f(value, shapes, None, loc, attn)), False),
        "torch.ops.msda.forward": (no_grad(lambda: torch.ops.msda.forward(value, shapes, starts, loc, attn)), False),
        "msda functional forward + backward": (step(f), True),
        "extension drop-in forward, no grad": (
            no_grad(lambda: extension.ms_deform_attn_forward(value, shapes, starts, loc, attn)), False
        ),
        "extension drop-in in its Function: forward + backward": (step(_DROP_IN_FUNCTION), True),
        "  that Function on torch.ops.msda.*: forward + backward": (step(_OPERATOR_FUNCTION), True),
        "  forward + backward, level_start_index=None": (step(f, None), True),
        f"noop-function x {chain}, one backward, per call": (chained(_NoopFunction.apply), True),
        f"msda x {chain}, one backward, per call": (chained(f), True),
    }
    if value.is_cuda:
        table["msda.eager.launch_backward (the kernels' smallest call)"] = (
            lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
            False,
        )
    try:
        op = deformops_msda()
    except Unavailable as e:
        print(f"deformops: {e}")
    else:
        table["deformops forward, no grad"] = (no_grad(lambda: op(value, shapes, starts, loc, attn)), False)
        table["deformops forward + backward"] = (step(op), True)
        table[f"deformops x {chain}, one backward, per call"] = (chained(op), True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="decoder", choices=["decoder", "encoder"])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chain", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.calls times eager CUDA calls: no GPU here")
    table = rows(PRESETS[args.preset], DTYPES[args.dtype], args.chain)
    samples: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(args.rounds):
        for name, (call, backward) in table.items():
            calls = max(1, args.calls // 3) if backward else args.calls
            per_call = end_to_end_time(call, calls=calls, repeats=1).median_us
            samples[name].append(per_call / (args.chain if f"x {args.chain}," in name else 1))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.preset} {args.dtype}, "
          f"median (min-max) of {args.rounds} rounds, us a call")  # fmt: skip
    for name, (call, _) in table.items():
        times = samples[name]
        device = profiler_device_time(call, calls=10, repeats=3).median_us
        if f"x {args.chain}," in name:
            device /= args.chain
        print(f"{name:58s} {statistics.median(times):8.1f} ({min(times):.1f}-{max(times):.1f})   device {device:7.1f}")


if __name__ == "__main__":
    main()
