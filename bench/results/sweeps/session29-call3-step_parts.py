"""Which part of an eager forward + backward costs what inside a step (issue 14; session 29, call 3).

Autograd Functions with the operator's signature that do part of msda's work: the do-nothing one
(bench.calls' noop-function), one whose forward launches msda's kernel (eager.launch_forward) and
whose backward allocates the gradients, one whose forward allocates the output and whose backward
launches msda's (eager.launch_backward), one doing both; then msda's functional form (which adds
the checks and the compile-ahead look-up). Each as forward + torch.autograd.grad over the three
leaves, wall us a step: median (min-max) of 7 rounds of 100 steps, one synchronize a round, the
rows in turns. At batch 1 the device takes ~20 us a step, so the host sets the pace; at batch 4
(the preset) ~75 us."""
import dataclasses
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

from bench.calls import _NoopFunction  # noqa: E402


class _ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        return eager.launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        value, loc, attn = ctx.saved_tensors
        return torch.empty_like(value), None, None, torch.empty_like(loc), torch.empty_like(attn)


class _BackwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        B, _, M, D = value.shape
        return value.new_empty((B, sampling_locations.shape[1], M * D))

    @staticmethod
    def backward(ctx, grad_output):
        grad_value, grad_loc, grad_attn = eager.launch_backward(grad_output, *ctx.saved_tensors)
        return grad_value, None, None, grad_loc, grad_attn


class _Both(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        return eager.launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        grad_value, grad_loc, grad_attn = eager.launch_backward(grad_output, *ctx.saved_tensors)
        return grad_value, None, None, grad_loc, grad_attn


def rows(batch):
    shape = dataclasses.replace(PRESETS["decoder"], batch=batch)
    inputs = make_inputs(shape, torch.float32, "cuda", dist="uniform", seed=3)
    value, shapes, starts, loc, attn = inputs.args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    v, lo, a = leaves
    grad = torch.randn(batch, loc.shape[1], value.shape[2] * value.shape[3], device="cuda")

    def step(op):
        return lambda: torch.autograd.grad(op(v, shapes, starts, lo, a), leaves, grad)

    return {
        "noop Function": step(_NoopFunction.apply),
        "forward launches msda's kernel": step(_ForwardOnly.apply),
        "backward launches msda's kernels": step(_BackwardOnly.apply),
        "both launch": step(_Both.apply),
        "msda functional": step(msda.multi_scale_deformable_attention),
        "launch_backward alone": lambda: eager.launch_backward(grad, value, shapes, starts, loc, attn),
    }


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for batch in (1, 4):
        table = rows(batch)
        for fn in table.values():
            for _ in range(10):
                fn()
        torch.cuda.synchronize()
        samples = {name: [] for name in table}
        for _ in range(7):
            for name, fn in table.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(100):
                    fn()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t) * 1e4)
        print(f"decoder preset, batch {batch}, float32: wall us a step, median (min-max) of 7 rounds")
        for name, times in samples.items():
            print(f"  {name:44s} {statistics.median(times):7.1f} ({min(times):.1f}-{max(times):.1f})", flush=True)


if __name__ == "__main__":
    main()
