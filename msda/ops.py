"""The registered operators torch.ops.msda.forward and torch.ops.msda.backward, and their softmax
forms torch.ops.msda.forward_softmax and torch.ops.msda.backward_softmax (attention logits,
normalized over the L * K samples of each head inside the kernels).

Read top to bottom: backend selection, the forward (validation, device branch, Triton launch),
the backward likewise, the fake implementations, what tracing does with CPU tensors, the autograd
registration; then the same for the softmax operators.

`spatial_shapes` and `level_start_index` stay device tensors that the kernels read: nothing on
the CUDA path reads tensor data on the host, so the operators capture into CUDA graphs and trace
with fullgraph=True.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from . import derivatives, torch_impl
from .validation import check_backward_args, check_forward_args, check_level_data, reject_forward_ad

try:
    import triton  # noqa: F401

    from .kernels import ahead, launch
    from .kernels.backward import (
        finish_grad_value,
        grad_value_buffer,
        msda_backward_kernel,
        msda_fold_replicas_kernel,
    )
    from .kernels.forward import msda_forward_kernel

    HAS_TRITON = True
    if os.environ.get("TRITON_INTERPRET") == "1":
        from .kernels import interpreter  # noqa: F401  (fma and bfloat16 conversions as on a GPU)
except ImportError:  # the pure-PyTorch path still works everywhere
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")
# auto: Triton kernels for CUDA tensors, pure PyTorch elsewhere. triton: the kernels everywhere
# (CPU tensors need TRITON_INTERPRET=1 set before import). torch: pure PyTorch everywhere.
BACKEND = os.environ.get("MSDA_BACKEND", "auto").strip().lower() or "auto"
if BACKEND not in BACKENDS:
    raise ValueError(f"MSDA_BACKEND must be one of {', '.join(BACKENDS)}, got {BACKEND!r}")


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on `device` run the Triton kernels (a static property under tracing)."""
    if BACKEND == "torch":
        return False
    if BACKEND == "auto":
        return HAS_TRITON and device.type == "cuda"
    if not HAS_TRITON:
        raise RuntimeError("MSDA_BACKEND=triton, but triton is not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"MSDA_BACKEND=triton runs {device.type} tensors only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing msda"
        )
    return True


def _on_device(device: torch.device):
    """Launch on the tensors' device, not whichever device is current: a Triton launch targets
    the current device (and its current stream), so cuda:1 tensors with cuda:0 current would
    otherwise hand one device's pointers to the other."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton_op("msda::forward", mutates_args=())
def forward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    reject_forward_ad("forward")
    level_start_index = check_level_data(value, spatial_shapes, level_start_index)
    if not uses_triton(value.device):
        return torch_impl.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    return _launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


@triton_op("msda::backward", mutates_args=())
def backward(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    check_backward_args(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    reject_forward_ad("backward")
    level_start_index = check_level_data(value, spatial_shapes, level_start_index)
    # The kernel's float atomic adds sum grad_value in whatever order they land, so its last bits
    # vary run to run. Under torch.use_deterministic_algorithms(True) each row is summed once from
    # lists of its samples instead (kernels/deterministic.py), bitwise run to run; float64
    # (gradcheck) takes the pure-PyTorch backward then, whose index_add is deterministic in that mode.
    if not uses_triton(value.device) or _deterministic_float64(value):
        return torch_impl.backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
        )

    return _launch_backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )


def _deterministic_float64(value: Tensor) -> bool:
    """float64 under torch.use_deterministic_algorithms(True): the pure-PyTorch backward (the
    deterministic kernels are for float32 and half precision, whose float64 is slow on most GPUs)."""
    return value.dtype == torch.float64 and torch.are_deterministic_algorithms_enabled()


# The kernel launches of the operators' bodies (the plain and the softmax form differ by one flag).
def _launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False):
    B, _, M, D = value.shape
    out = launch.empty_written_whole((B, sampling_locations.shape[1], M * D), value.dtype, value.device)
    if out.numel() > 0:
        grid, args, constexprs = launch.forward_call(
            value.contiguous(),
            spatial_shapes.contiguous(),
            level_start_index.contiguous(),
            sampling_locations.contiguous(),
            attention_weights.contiguous(),
            out,
            softmax=softmax,
        )
        with _on_device(value.device):
            kernel, kwargs = launch.traceable(msda_forward_kernel, constexprs)
            wrap_triton(kernel)[grid](*args, **kwargs)
    return out


def _launch_backward(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False
):
    """(grad_value, grad_loc, grad_attn); softmax: attention_weights holds logits, grad_attn is
    their gradient."""
    _, Q, _, L, K, _ = sampling_locations.shape
    # The kernels read grad_output's channels contiguous (its other strides may be anything) and
    # every other tensor contiguous: made so once, for the backward and the lists alike.
    if grad_output.stride(2) != 1:
        grad_output = grad_output.contiguous()
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        t.contiguous() for t in (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    )
    # Softmax weights are at most 1: the fixed-point bound needs no max over the logits.
    # The deterministic mode sums grad_value from lists of samples (kernels/deterministic.py), except
    # in the fused-softmax kernels (their weights exist only inside the kernel): 64-bit atomics.
    grad_value, fixed_point_scale, replicas, fold_counts = grad_value_buffer(
        value, grad_output, None if softmax else attention_weights, Q, L, K, lists=not softmax
    )
    # Every element of these two is written by exactly one program: no zeroing needed.
    grad_loc = launch.empty_written_whole(sampling_locations.shape, sampling_locations.dtype, value.device)
    grad_attn = launch.empty_written_whole(attention_weights.shape, attention_weights.dtype, value.device)
    # The deterministic mode's lists are counted by the backward kernel (kernels/deterministic.py).
    lists = launch.list_buffers(value, sampling_locations, attention_weights) if grad_value is None else None
    # With softmax the kernel keeps the gradient of the weights here between its level loop and
    # its softmax pass. A buffer of its own (the eager fast path reuses grad_attn where the dtypes
    # allow): two written arguments that alias could keep torch.compile from reinplacing either.
    scratch = None
    if softmax:
        scratch = torch.empty(
            attention_weights.shape,
            dtype=launch.softmax_scratch_dtype(value, sampling_locations, attention_weights),
            device=value.device,
        )
    if grad_attn.numel() > 0:
        # The Gluon kernel is not traceable: a traced call reaches it through msda::add_shared_tile_.
        shared_tile = launch.shared_tile_applies(
            value, sampling_locations, grad_output, grad_value, softmax=softmax,
            fixed_point=fixed_point_scale is not None, replicas=replicas is not None,
        )  # fmt: skip
        grid, args, constexprs = launch.backward_call(
            grad_output,
            value,
            spatial_shapes,
            level_start_index,
            sampling_locations,
            attention_weights,
            grad_value,
            grad_loc,
            grad_attn,
            softmax=softmax,
            scratch=scratch,
            fixed_point_scale=fixed_point_scale,
            replicas=replicas,
            fold_counts=fold_counts,
            lists=lists,
            shared_tile=shared_tile,
        )
        with _on_device(value.device):
            # Each launch first waits for the compile the forward began (launch.compile_backward_ahead), if any.
            ahead.wait(msda_backward_kernel)
            kernel, kwargs = launch.traceable(msda_backward_kernel, constexprs)
            wrap_triton(kernel)[grid](*args, **kwargs)
            if replicas is not None and fold_counts is None:  # else the backward kernel folded them
                grid, args, constexprs = launch.fold_call(grad_value, replicas, spatial_shapes, level_start_index, Q, K)
                ahead.wait(msda_fold_replicas_kernel)
                wrap_triton(msda_fold_replicas_kernel)[grid](*args, **constexprs)
        if shared_tile:
            tile_args = (grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
            if type(grad_value) is torch.Tensor:  # eager: launch it here (no second dispatch)
                _launch_shared_tile(*tile_args, grad_value)
            else:  # traced: an opaque call (Inductor cannot compile Gluon kernels)
                torch.ops.msda.add_shared_tile_(*tile_args, grad_value)
    if grad_value is None:  # the deterministic mode's lists
        if grad_attn.numel() == 0:
            return torch.zeros_like(value), grad_loc, grad_attn
        with _on_device(value.device):
            grad_value = launch.deterministic_grad_value(
                _traceable_launch, lists, grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights,
            )  # fmt: skip
        return grad_value, grad_loc, grad_attn
    return finish_grad_value(grad_value, fixed_point_scale, value.dtype), grad_loc, grad_attn


def _launch_shared_tile(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_value
) -> None:
    """Add the last level's grad_value, summed in shared memory (kernels/shared_tile.py), into
    grad_value, after the backward kernel left those adds out (launch.shared_tile_applies)."""
    grid, args, constexprs = launch.shared_tile_call(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_value
    )
    ahead.wait(launch.msda_shared_tile_kernel)  # launch.compile_backward_ahead's compile, if one began
    with _on_device(value.device):
        launch.msda_shared_tile_kernel[grid](*args, **constexprs)


# Not a triton_op: Inductor cannot compile the Gluon kernel, and keeps a custom op opaque (an
# extern call on real tensors when the graph runs). The traced backward body calls it.
@torch.library.custom_op("msda::add_shared_tile_", mutates_args=("grad_value",), device_types="cuda")
def _add_shared_tile_op(
    grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
    sampling_locations: Tensor, attention_weights: Tensor, grad_value: Tensor,
) -> None:  # fmt: skip
    _launch_shared_tile(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_value
    )


@_add_shared_tile_op.register_fake
def _add_shared_tile_fake(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_value
) -> None:
    return None


def _traceable_launch(kernel, grid, args, constexprs) -> None:
    wrap_triton(kernel)[grid](*args, **constexprs)


# Fake implementations: exactly what the bodies return (fresh contiguous tensors), with the same
# metadata checks, so a bad call fails at trace time with the eager error.
@forward.register_fake
def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    B, _, M, D = value.shape
    return value.new_empty((B, sampling_locations.shape[1], M * D))


@backward.register_fake
def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    check_backward_args(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return (
        torch.empty_like(value, memory_format=torch.contiguous_format),
        torch.empty_like(sampling_locations, memory_format=torch.contiguous_format),
        torch.empty_like(attention_weights, memory_format=torch.contiguous_format),
    )


def _keep_whole_on_cpu(op) -> None:
    """Under tracing (torch.compile's AOTDispatcher, opcheck), triton_op decomposes the operator
    into its body, so that Inductor compiles the Triton kernels into the graph. For tensors whose
    body is torch_impl on CPU, keep the operator whole instead: one node, which runs torch_impl's
    CPU kernels at run time (FBGEMM's embedding_bag and the like). Inductor's code for the traced
    body was slower than those (Deformable DETR's decoder forward at 800x1333, one thread: 4.5 ms
    traced, 1.7 ms eager). Other devices are decomposed as before."""
    decompose = getattr(op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)  # triton_op's rule
    if decompose is None:  # a torch that no longer registers it: nothing to keep whole
        return

    def rule(mode, func, types, args, kwargs):
        device = args[0].device  # value (forward) or grad_output (backward): the operator's device
        if device.type == "cpu" and not uses_triton(device):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        return decompose(mode, func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, rule)


_keep_whole_on_cpu(forward)
_keep_whole_on_cpu(backward)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _setup_forward_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    if HAS_TRITON:  # the backward's kernels, compiled in a thread (never while tracing)
        launch.compile_backward_ahead(*inputs)


def _backward_rule(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_loc, grad_attn = torch.ops.msda.backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    return grad_value, None, None, grad_loc, grad_attn


forward.register_autograd(_backward_rule, setup_context=_setup_forward_context)


# The backward's own derivative (double backward: gradient penalties, Hessian-vector products).
backward.register_autograd(derivatives.backward_backward, setup_context=derivatives.backward_setup_context)


# --- The softmax operators --------------------------------------------------------------------
# The same with attention logits in place of the weights: the weights are softmax(logits) over
# the L * K samples of each (batch, query, head), computed in the kernels (a first pass over the
# logits, which are few, for their max and sum), and the backward returns the logits' gradient.

LOGITS = "attention_logits"  # the argument's name in error messages


@triton_op("msda::forward_softmax", mutates_args=())
def forward_softmax(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> Tensor:
    check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_logits, LOGITS)
    reject_forward_ad("forward_softmax")
    level_start_index = check_level_data(value, spatial_shapes, level_start_index)
    if not uses_triton(value.device):
        return torch_impl.forward_softmax(
            value, spatial_shapes, level_start_index, sampling_locations, attention_logits
        )
    if not launch.FUSED_SOFTMAX:  # torch.softmax, then the plain kernels (launch.FUSED_SOFTMAX says why)
        weights = torch_impl.softmax_weights(attention_logits, value, sampling_locations)
        return torch.ops.msda.forward(value, spatial_shapes, level_start_index, sampling_locations, weights)

    return _launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_logits, softmax=True)


@triton_op("msda::backward_softmax", mutates_args=())
def backward_softmax(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    check_backward_args(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits, LOGITS
    )
    reject_forward_ad("backward_softmax")
    level_start_index = check_level_data(value, spatial_shapes, level_start_index)
    if not uses_triton(value.device) or _deterministic_float64(value):  # as msda::backward
        return torch_impl.backward_softmax(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits
        )
    if not launch.FUSED_SOFTMAX:  # torch.softmax, then the plain kernels (launch.FUSED_SOFTMAX says why)
        return torch_impl.backward_through_softmax(
            torch.ops.msda.backward, grad_output, value, spatial_shapes, level_start_index, sampling_locations,
            attention_logits,
        )  # fmt: skip

    return _launch_backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits, softmax=True
    )


@forward_softmax.register_fake
def _forward_softmax_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
    check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_logits, LOGITS)
    B, _, M, D = value.shape
    return value.new_empty((B, sampling_locations.shape[1], M * D))


@backward_softmax.register_fake
def _backward_softmax_fake(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits
):
    check_backward_args(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits, LOGITS
    )
    return (
        torch.empty_like(value, memory_format=torch.contiguous_format),
        torch.empty_like(sampling_locations, memory_format=torch.contiguous_format),
        torch.empty_like(attention_logits, memory_format=torch.contiguous_format),
    )


def _backward_softmax_rule(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_logits = ctx.saved_tensors
    grad_value, grad_loc, grad_logits = torch.ops.msda.backward_softmax(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits
    )
    return grad_value, None, None, grad_loc, grad_logits


forward_softmax.register_autograd(_backward_softmax_rule, setup_context=_setup_context)
_keep_whole_on_cpu(forward_softmax)
_keep_whole_on_cpu(backward_softmax)


def _no_double_backward_softmax(ctx, *grads):
    raise NotImplementedError(
        "msda: the softmax form (msda::backward_softmax) has no second derivative; for double "
        "backward, normalize the logits with torch.softmax and call msda.multi_scale_deformable_attention"
    )


backward_softmax.register_autograd(_no_double_backward_softmax, setup_context=lambda ctx, inputs, output: None)
