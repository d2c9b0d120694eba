"""The eager fast path: what an eager call on CUDA tensors costs beyond its kernels.

Calling the registered operator costs ~100 us of Python per call before the kernel starts
(torch's custom-op dispatch, the autograd wrapper, the Triton JIT's argument binding;
bench/NOTES.md has the profile), more than the decoder's forward kernel takes. In eager mode,
on plain CUDA tensors with nothing tracing them, the functional form, the layer and the
drop-ins call `forward` / `backward` here instead, which check the arguments and launch the
compiled kernels directly (msda/kernels/direct.py), with a `torch.autograd.Function` for
gradients. `softmax=True` is the same for the softmax operators (msda::forward_softmax /
msda::backward_softmax: attention logits in place of the weights). Plain CPU tensors take the
CPU's fast path (msda/eager_cpu.py), to which `forward` / `backward` pass them. Everything else
(torch.compile, export, fake tensors, torch.func transforms, forward-mode AD) goes through
`torch.ops.msda.*`, the same kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager_cpu, ops, torch_impl, validation

if ops.HAS_TRITON:
    from .kernels import ahead, launch
    from .kernels.backward import (
        finish_grad_value,
        grad_value_buffer,
        msda_backward_kernel,
        msda_fold_replicas_kernel,
    )
    from .kernels import deterministic
    from .kernels.direct import DirectLauncher
    from .kernels.forward import msda_forward_kernel

    _forward_kernel = DirectLauncher(msda_forward_kernel)
    _backward_kernel = DirectLauncher(msda_backward_kernel)
    _fold_kernel = DirectLauncher(msda_fold_replicas_kernel)
    _LISTS = {kernel: DirectLauncher(kernel) for kernel in deterministic.KERNELS}
    _shared_tile_kernel = launch.msda_shared_tile_kernel and DirectLauncher(launch.msda_shared_tile_kernel)

_FLOATS = frozenset(validation.FLOAT_DTYPES)
_INDICES = frozenset(validation.INDEX_DTYPES)


def eligible(value, spatial_shapes, level_start_index, *tensors) -> bool:
    """Whether a call on these tensors may skip the registered operator: plain CUDA tensors
    (not fake, functional or batched; level_start_index may be None), nothing compiling or
    tracing, no forward-mode AD."""
    return (
        ops.HAS_TRITON
        and type(value) is Tensor
        and value.is_cuda
        and ops.BACKEND != "torch"
        and type(spatial_shapes) is Tensor
        and (level_start_index is None or type(level_start_index) is Tensor)
        and all(type(t) is Tensor for t in tensors)
        and validation.untraced()
    )


def _looks_valid(value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> bool:
    """The operator's metadata checks for the common case, in a few comparisons. (A nested
    tensor raises at .shape, which every tensor here is asked: `_check` then runs the full checks.)"""
    v, loc, attn, shapes, starts = value, sampling_locations, attention_weights, spatial_shapes, level_start_index
    device, loc_shape = v.device, loc.shape
    return (
        v.dim() == 4
        and len(loc_shape) == 6
        and v.dtype in _FLOATS
        and loc.dtype in _FLOATS
        and attn.dtype in _FLOATS
        and shapes.dtype in _INDICES
        and v.layout == loc.layout == attn.layout == shapes.layout == torch.strided
        and loc_shape[0] == v.shape[0]
        and loc_shape[2] == v.shape[2]
        and loc_shape[5] == 2
        and attn.shape == loc_shape[:5]
        and shapes.shape == (loc_shape[3], 2)
        and 0 not in loc_shape[2:5]
        and v.shape[3] > 0
        and loc.device == device
        and attn.device == device
        and shapes.device == device
        and (
            starts is None
            or (
                starts.dtype in _INDICES
                and starts.layout == torch.strided
                and starts.shape == (loc_shape[3],)
                and starts.device == device
            )
        )
    )


def _check(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False) -> None:
    """Raise the operator's error for a call outside its contract: a few comparisons for a valid
    call, the operator's full checks for anything unusual, and while msda.validate() is on (the
    level data, at the cost of a host sync)."""
    if not validation.enabled():
        try:
            if _looks_valid(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
                return
        except Exception:  # noqa: BLE001  (anything odd: the full checks say what)
            pass
    if level_start_index is None:
        validation.check_tensor("spatial_shapes", spatial_shapes)
        level_start_index = _starts(spatial_shapes, None)
    name = validation.weights_name(softmax)
    validation.check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, name)


def _contiguous(*tensors: Tensor | None):
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)


def _device_guard(device: torch.device):
    """The current device must be the tensors' for a launch (see ops._on_device)."""
    return None if device.index == torch.cuda.current_device() else torch.cuda.device(device)


def _call_on_device(device: torch.device, call, *args):
    """call(*args) with `device` current (a launch goes to the current device's stream)."""
    guard = _device_guard(device)
    if guard is None:
        return call(*args)
    with guard:
        return call(*args)


def _launch(launcher, grid, args, constexprs, device) -> None:
    _call_on_device(device, launcher, grid, args, constexprs, device)


# The launches as `DirectLauncher.prepare` resolved them, by `launch.forward_signature`,
# `launch.backward_signature` and `launch.fold_signature` (None: that call's launch could not be
# prepared). With one, an eager call skips the argument builder and the launcher's key
# (bench/NOTES.md entries 73 and 75).
_forward_launches: dict[tuple, object] = {}
_backward_launches: dict[tuple, object] = {}
_fold_launches: dict[tuple, object] = {}
_MAX_PREPARED = 256


def _launch_prepared(launches: dict, key: tuple, tensors: tuple, device: torch.device) -> bool:
    """Whether a launch prepared under `key` ran, on `tensors`."""
    prepared = launches.get(key)
    return prepared is not None and _call_on_device(device, prepared, tensors)


def _keep_prepared(launches: dict, key: tuple, launcher, grid, args, constexprs, device) -> None:
    """Keep under `key` the launch `launcher` has just made (at most _MAX_PREPARED of them: a
    process of many shapes starts again)."""
    if key not in launches:
        if len(launches) >= _MAX_PREPARED:
            launches.clear()
        launches[key] = launcher.prepare(grid, args, constexprs, device)


def launch_forward(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False
) -> Tensor:
    """The forward kernel on checked CUDA tensors (level_start_index may be None; softmax: the
    last tensor holds logits)."""
    if softmax and not launch.FUSED_SOFTMAX:  # torch.softmax, then the plain kernel (launch.py says why)
        weights = torch_impl.softmax_weights(attention_weights, value, sampling_locations)
        return launch_forward(value, spatial_shapes, level_start_index, sampling_locations, weights)
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = _contiguous(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    B, _, M, D = value.shape
    out = launch.new_empty_written_whole(value, (B, sampling_locations.shape[1], M * D))
    if out.numel() > 0:
        key = launch.forward_signature(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax
        )
        tensors = launch.forward_tensors(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out
        )
        if not _launch_prepared(_forward_launches, key, tensors, value.device):
            grid, args, constexprs = launch.forward_call(
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out, softmax=softmax
            )
            _launch(_forward_kernel, grid, args, constexprs, value.device)
            _keep_prepared(_forward_launches, key, _forward_kernel, grid, args, constexprs, value.device)
    return out


def launch_backward(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False
):
    """The backward kernel on checked CUDA tensors: (grad_value, grad_loc, grad_attn); softmax:
    the last tensor holds logits, and grad_attn is their gradient."""
    if softmax and not launch.FUSED_SOFTMAX:  # torch.softmax, then the plain kernel (launch.py says why)
        return torch_impl.backward_through_softmax(
            launch_backward, grad_output, value, spatial_shapes, level_start_index, sampling_locations,
            attention_weights,
        )  # fmt: skip
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = _contiguous(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    if grad_output.stride(2) != 1:
        grad_output = grad_output.contiguous()
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    grad_value, fixed_point_scale, replicas, fold_counts = grad_value_buffer(
        value, grad_output, None if softmax else attention_weights, Q, L, K, lists=not softmax
    )
    grad_loc = launch.new_empty_written_whole(sampling_locations)
    grad_attn = launch.new_empty_written_whole(attention_weights)
    # The deterministic mode's lists' buffers, which the backward kernel writes first.
    lists = launch.list_buffers(value, sampling_locations, attention_weights) if grad_value is None else None
    scratch = None
    if softmax:
        # The kernel keeps the weights' gradient here until its softmax pass: grad_attn itself
        # where it has the compute dtype (no torch.compile here to mind the aliasing).
        scratch_dtype = launch.softmax_scratch_dtype(value, sampling_locations, attention_weights)
        scratch = grad_attn if scratch_dtype == grad_attn.dtype else torch.empty_like(grad_attn, dtype=scratch_dtype)
    if grad_attn.numel() > 0:
        shared_tile = launch.shared_tile_applies(
            value, sampling_locations, grad_output, grad_value, softmax=softmax,
            fixed_point=fixed_point_scale is not None, replicas=replicas is not None,
        )  # fmt: skip
        # Each launch first waits for the compile the forward began (launch.compile_backward_ahead), if any.
        ahead.wait(msda_backward_kernel)
        # A plain call (grad_value zeros, and replicas where it has them, that this kernel alone
        # adds into) may take a prepared launch, and so may its fold.
        plain = grad_value is not None and fixed_point_scale is None and not (softmax or shared_tile)
        key = None
        if plain:
            key = launch.backward_signature(
                grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                grad_value, replicas, fold_counts,
            )  # fmt: skip
            tensors = launch.backward_tensors(
                grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                grad_value, grad_loc, grad_attn, replicas=replicas, fold_counts=fold_counts,
            )  # fmt: skip
        if not (plain and _launch_prepared(_backward_launches, key, tensors, value.device)):
            grid, args, constexprs = launch.backward_call(
                grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                grad_value, grad_loc, grad_attn, softmax=softmax, scratch=scratch,
                fixed_point_scale=fixed_point_scale, replicas=replicas, fold_counts=fold_counts, lists=lists,
                shared_tile=shared_tile,
            )  # fmt: skip
            _launch(_backward_kernel, grid, args, constexprs, value.device)
            if plain:
                _keep_prepared(_backward_launches, key, _backward_kernel, grid, args, constexprs, value.device)
        if replicas is not None and fold_counts is None:  # else the backward kernel folded them
            _launch_fold(grad_value, replicas, spatial_shapes, level_start_index, Q, K, value.device)
        if shared_tile:
            grid, args, constexprs = launch.shared_tile_call(
                grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                grad_value,
            )  # fmt: skip
            ahead.wait(launch.msda_shared_tile_kernel)
            _launch(_shared_tile_kernel, grid, args, constexprs, value.device)
    if grad_value is None:  # the deterministic mode's lists (ops._launch_backward has the same)
        if grad_attn.numel() == 0:
            return torch.zeros_like(value), grad_loc, grad_attn
        grad_value = launch.deterministic_grad_value(
            lambda kernel, grid, args, constexprs: _launch(_LISTS[kernel], grid, args, constexprs, value.device),
            lists, grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        )  # fmt: skip
        return grad_value, grad_loc, grad_attn
    return finish_grad_value(grad_value, fixed_point_scale, value.dtype), grad_loc, grad_attn


def _launch_fold(grad_value, replicas, spatial_shapes, level_start_index, num_queries, num_points, device) -> None:
    """The replicas' fold after the backward kernel, prepared where a call of its key ran before."""
    key = launch.fold_signature(grad_value, replicas, spatial_shapes, level_start_index, num_queries, num_points)
    tensors = launch.fold_tensors(grad_value, replicas, spatial_shapes, level_start_index)
    if not _launch_prepared(_fold_launches, key, tensors, device):
        grid, args, constexprs = launch.fold_call(
            grad_value, replicas, spatial_shapes, level_start_index, num_queries, num_points
        )
        ahead.wait(msda_fold_replicas_kernel)
        _launch(_fold_kernel, grid, args, constexprs, device)
        _keep_prepared(_fold_launches, key, _fold_kernel, grid, args, constexprs, device)


def _starts(spatial_shapes: Tensor, level_start_index: Tensor | None) -> Tensor:
    if level_start_index is not None:
        return level_start_index
    from .functional import level_start_index_from_shapes

    return level_start_index_from_shapes(spatial_shapes)


def _kernel_backward_eligible(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
) -> bool:
    """Whether the backward may launch the kernel directly: `eligible` tensors, no graph of the
    backward to record (create_graph: the operator has the double backward), and not the
    deterministic float64 backward (the pure-PyTorch one)."""
    return (
        eligible(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output)
        and not (value.dtype == torch.float64 and torch.are_deterministic_algorithms_enabled())
        and not torch.is_grad_enabled()
    )


def backward(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False
):
    """(grad_value, grad_loc, grad_attn): the backward kernel where eligible (on CPU with grad
    mode off, the CPU path's backward), else the operator (msda::backward, or
    msda::backward_softmax with softmax=True)."""
    if _kernel_backward_eligible(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    ):
        _check(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax)
        validation.check_tensor("grad_output", grad_output)
        expected = (value.shape[0], sampling_locations.shape[1], value.shape[2] * value.shape[3])
        if grad_output.shape != expected or grad_output.device != value.device:
            starts = _starts(spatial_shapes, level_start_index)
            validation.check_backward_args(
                grad_output, value, spatial_shapes, starts, sampling_locations, attention_weights,
                validation.weights_name(softmax),
            )  # fmt: skip
        return launch_backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax
        )
    starts = _starts(spatial_shapes, level_start_index)
    if not torch.is_grad_enabled() and eager_cpu.eligible(
        value, spatial_shapes, starts, sampling_locations, attention_weights, grad_output
    ):  # the CPU path's backward without the operator's dispatch (msda/eager_cpu.py)
        return eager_cpu.backward(
            grad_output, value, spatial_shapes, starts, sampling_locations, attention_weights, softmax
        )
    if not torch.compiler.is_compiling():  # (traced, they are tensors; a traced backward may not read .layout)
        validation.check_operator_args(
            validation.weights_name(softmax), grad_output=grad_output, value=value, spatial_shapes=spatial_shapes,
            level_start_index=starts, sampling_locations=sampling_locations, attention=attention_weights,
        )  # fmt: skip
    op = torch.ops.msda.backward_softmax if softmax else torch.ops.msda.backward
    return op(grad_output, value, spatial_shapes, starts, sampling_locations, attention_weights)


class _Function(torch.autograd.Function):
    """Autograd for the eager fast path (the registered operator has its own, for tracing)."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        ctx.softmax = softmax
        if not softmax:
            launch.compile_backward_ahead(
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights
            )
        return launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax)

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        if _kernel_backward_eligible(grad_output, *saved):
            # The forward checked the saved tensors, and autograd hands over a grad_output of
            # the output's shape, dtype and device: launch without checking again.
            grad_value, grad_loc, grad_attn = launch_backward(grad_output, *saved, ctx.softmax)
        else:  # create_graph (double backward), compiled autograd, a dispatch mode: the operator
            grad_value, grad_loc, grad_attn = backward(grad_output, *saved, ctx.softmax)
        return grad_value, None, None, grad_loc, grad_attn, None


def differentiable_forward(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False
):
    """The fast path's forward, differentiable, on tensors `eligible` accepted."""
    _check(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax)
    if torch.is_grad_enabled() and (
        value.requires_grad or sampling_locations.requires_grad or attention_weights.requires_grad
    ):
        return _Function.apply(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax)
    return launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax)


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False) -> Tensor:
    """The operator's forward, differentiable: the eager fast path where eligible (on CPU, the
    one of msda/eager_cpu.py), else torch.ops.msda.forward (torch.ops.msda.forward_softmax with
    softmax=True, the last tensor then holding logits). level_start_index may be None."""
    if eligible(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return differentiable_forward(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax
        )
    starts = _starts(spatial_shapes, level_start_index)
    if eager_cpu.eligible(value, spatial_shapes, starts, sampling_locations, attention_weights):
        return eager_cpu.forward(value, spatial_shapes, starts, sampling_locations, attention_weights, softmax)
    if not torch.compiler.is_compiling():
        validation.check_operator_args(
            validation.weights_name(softmax), value=value, spatial_shapes=spatial_shapes, level_start_index=starts,
            sampling_locations=sampling_locations, attention=attention_weights,
        )  # fmt: skip
    op = torch.ops.msda.forward_softmax if softmax else torch.ops.msda.forward
    return op(value, spatial_shapes, starts, sampling_locations, attention_weights)
