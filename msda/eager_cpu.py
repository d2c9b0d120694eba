"""The eager fast path on CPU: the CPU path's functions without the operator's dispatch cost.

An eager call of torch.ops.msda.* on CPU tensors pays the custom operator's Python wrappers
(torch.library's autograd and backend dispatch) on top of the CPU path's own work: about 120 us a
forward and 500 us a forward + backward on a CPU whose empty tensor op takes 3.6 us, where a
400x667 decoder's forward takes about 1.5 ms (bench/NOTES.md entry 84). As msda/eager.py does for
CUDA, the functional form (and so the layer and the drop-ins built on it) calls `forward` here on
plain CPU tensors in eager mode: the operator's checks, the very functions its body runs
(msda/torch_impl.py), and a torch.autograd.Function for the gradients. Anything else (tracing,
torch.func, forward-mode AD, MSDA_BACKEND=triton's interpreter) goes through the operator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops, torch_impl, validation


def eligible(value, spatial_shapes, level_start_index, *tensors) -> bool:
    """Whether a call may skip the registered operator: plain CPU tensors (level_start_index may
    be None) that the pure-PyTorch path runs, nothing tracing them."""
    return (
        not torch.compiler.is_compiling()
        and ops.BACKEND != "triton"
        and all(
            type(t) is Tensor and t.device.type == "cpu"
            for t in (value, spatial_shapes, *tensors, *([] if level_start_index is None else [level_start_index]))
        )
        and validation.untraced()
    )


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax=False) -> Tensor:
    """The operator's forward (its softmax form with softmax=True: `attention` holds logits),
    differentiable, on tensors `eligible` accepted."""
    name = validation.weights_name(softmax)
    validation.check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention, name)
    if torch.is_grad_enabled() and (value.requires_grad or sampling_locations.requires_grad or attention.requires_grad):
        return _Function.apply(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax)
    return _cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax)


def backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention, softmax=False):
    """The operator's backward (of its softmax form with softmax=True): (grad_value, grad_loc,
    grad_attention), on tensors `eligible` accepted, with grad mode off (a graph of the backward
    needs the operator, which has the double backward)."""
    args = (grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention)
    validation.check_backward_args(*args, validation.weights_name(softmax))
    return _cpu_backward(*args, softmax)


def _cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax):
    """What the operator's body runs on eager CPU tensors (msda/ops.py, msda/torch_impl.py)."""
    if softmax:
        attention = torch_impl.softmax_weights(attention, value, sampling_locations)
    return torch_impl._cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention)


def _cpu_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention, softmax):
    """What the backward operators' bodies run on eager CPU tensors."""
    args = (grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention)
    return torch_impl.backward_softmax(*args) if softmax else torch_impl._cpu_backward(*args)


class _Function(torch.autograd.Function):
    """Autograd for the CPU fast path (the registered operator has its own, for tracing)."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention, softmax):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention)
        ctx.softmax = softmax
        return _cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax)

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        if torch.is_grad_enabled() or not validation.untraced():
            # create_graph (the operator has the double backward), compiled autograd: the operator.
            op = torch.ops.msda.backward_softmax if ctx.softmax else torch.ops.msda.backward
            grad_value, grad_loc, grad_attn = op(grad_output, *saved)
        else:  # autograd hands over a grad_output of the output's shape, dtype and device
            grad_value, grad_loc, grad_attn = _cpu_backward(grad_output, *saved, ctx.softmax)
        return grad_value, None, None, grad_loc, grad_attn, None
