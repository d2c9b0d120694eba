"""Helpers shared by the tests: run the operator and compare with the float64 reference."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch
from torch import Tensor

import msda
from msda import ops
from msda.kernels import backward as backward_kernel
from msda.kernels import deterministic, launch
from msda.testing import Inputs, reference_with_grads, relative_error, tolerance

GRAD_NAMES = ("output", "grad_value", "grad_sampling_locations", "grad_attention_weights")


@contextlib.contextmanager
def operator_bodies():
    """Counts the registered operators' bodies entered (msda::forward, msda::backward and their
    softmax forms each check their arguments first, through msda.ops' own names for the checks;
    the eager fast paths check theirs through msda.validation): `entered()` is 0 where every call
    skipped the operator."""
    with (
        mock.patch.object(ops, "check_forward_args", wraps=ops.check_forward_args) as forward,
        mock.patch.object(ops, "check_backward_args", wraps=ops.check_backward_args) as backward,
    ):
        yield lambda: forward.call_count + backward.call_count


def forward_backward(inputs: Inputs, grad_output: Tensor, fn=msda.multi_scale_deformable_attention):
    """Output and the three gradients of `fn` through autograd (inputs are detached copies)."""
    value = inputs.value.detach().clone().requires_grad_()
    loc = inputs.sampling_locations.detach().clone().requires_grad_()
    attn = inputs.attention_weights.detach().clone().requires_grad_()
    out = fn(value, inputs.spatial_shapes, inputs.level_start_index, loc, attn)
    out.backward(grad_output)
    return out.detach(), value.grad, loc.grad, attn.grad


def assert_matches_reference(
    inputs: Inputs, results, grad_output: Tensor, scale: float = 1.0, softmax: bool = False
) -> dict[str, float]:
    """Assert output and gradients are within the bound of docs/contract.md of the float64 reference.

    The bound is that of the least precise dtype among the inputs (a float16 value limits the
    accuracy of the location gradient too). softmax: inputs.attention_weights holds logits, the
    softmax operators' input (msda.testing.reference_softmax). Returns the errors for printing.
    """
    expected = reference_with_grads(inputs, grad_output, softmax=softmax)
    dtypes = (inputs.value.dtype, inputs.sampling_locations.dtype, inputs.attention_weights.dtype)
    bound = tolerance(*dtypes) * scale
    errors = {}
    for name, actual, ref, like in zip(
        GRAD_NAMES,
        results,
        expected,
        (inputs.value, inputs.value, inputs.sampling_locations, inputs.attention_weights),
    ):
        assert actual.dtype == like.dtype, f"{name}: dtype {actual.dtype}, expected {like.dtype}"
        assert actual.device == like.device, f"{name}: device {actual.device}, expected {like.device}"
        errors[name] = relative_error(actual, ref)
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"relative errors {bad} exceed {bound:.1e} (dtypes {dtypes}); all: {errors}"
    return errors


def random_like_output(inputs: Inputs, seed: int = 1) -> Tensor:
    B, Q, M = inputs.attention_weights.shape[:3]
    D = inputs.value.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, Q, M * D, generator=gen).to(inputs.value.device, inputs.value.dtype)


def atomic_fixed_point_grad_value(grad_output: Tensor, value, shapes, starts, loc, attn) -> Tensor:
    """The deterministic mode's grad_value by the backward kernel's 64-bit atomic adds of its
    fixed-point contributions (the fused-softmax kernels' path), in the value's dtype."""
    scale = backward_kernel.fixed_point_scale(grad_output, attn, loc.shape[1] * loc.shape[3] * loc.shape[4])
    fixed = torch.zeros(value.shape, dtype=torch.int64, device=value.device)
    grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, fixed,
                                                  torch.empty_like(loc), torch.empty_like(attn),
                                                  fixed_point_scale=scale)  # fmt: skip
    backward_kernel.msda_backward_kernel[grid](*args, **constexprs)
    return backward_kernel.from_fixed_point(fixed, scale, value.dtype)


def listed_grad_value(run, grad_output: Tensor, value, shapes, starts, loc, attn) -> Tensor:
    """The deterministic mode's grad_value as the operator makes it: the backward kernel without
    grad_value counting the lists, then the lists' kernels (launched by `run(kernel, grid, args,
    constexprs)`); asserts that the lists' kernel wrote every slot the counts made (each sample
    listed as counted) and each sample's four corner weights over its rank."""
    lists = launch.list_buffers(value, loc, attn)
    grads = [torch.empty_like(loc), torch.empty_like(attn)]
    grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, None, *grads,
                                                  lists=lists)  # fmt: skip
    lists.weights.fill_(math.nan)  # (not a rank: its bits as an integer are far past any list)
    backward_kernel.msda_backward_kernel[grid](*args, **constexprs)
    slots = []

    def checked(kernel, grid, args, constexprs):
        if kernel is deterministic.msda_sample_lists_kernel:
            ends, entries = args[4], args[5]
            slots.append(int(ends[-1]) if len(ends) else 0)
            entries[: slots[-1]] = -1  # no entry is negative
            run(kernel, grid, args, constexprs)
            assert (entries[: slots[-1]] >= 0).all(), "a slot the counts made was not written"
            return
        run(kernel, grid, args, constexprs)

    listed = launch.deterministic_grad_value(checked, lists, grad_output, value, shapes, starts, loc, attn)
    assert slots, "the lists' kernel ran"
    if attn.isfinite().all():
        assert not lists.weights.isnan().any(), "every sample's corner weights written"
    return listed


def sorted_lists_grad_value(grad_output: Tensor, value, shapes, starts, loc, attn, seed: int | None = None):
    """(grad_value, longest list) of the deterministic mode with its lists sorted (`ListRule.sorted_sums`),
    each list's slots shuffled first (seed None: as the lists' kernel took them); asserts that
    the sort kernel wrote each list in ascending order, a permutation of its entries."""
    longest = []

    def run(kernel, grid, args, constexprs):
        if kernel is deterministic.msda_sort_lists_kernel:
            ends, all_entries, all_listed = args[:3]
            lengths = torch.diff(ends, prepend=ends.new_zeros(1)).long()
            which = torch.repeat_interleave(torch.arange(len(ends), device=ends.device), lengths)
            entries, listed = all_entries[: len(which)], all_listed[: len(which)]  # (samples not listed: none)
            if seed is not None:  # a random order within each list, the lists in place
                gen = torch.Generator().manual_seed(seed)
                order = torch.argsort(which.cpu().double() + torch.rand(len(which), generator=gen, dtype=torch.float64))
                entries.copy_(entries[order.to(entries.device)])
            longest.append(int(lengths.max()) if len(lengths) else 0)
            kernel[grid](*args, **constexprs)
            by_entry = torch.argsort(entries, stable=True)
            expected = entries[by_entry][torch.argsort(which[by_entry], stable=True)]  # by list, then entry
            assert torch.equal(listed, expected), "each list sorted, a permutation of its entries"
            return
        kernel[grid](*args, **constexprs)

    listed = listed_grad_value(run, grad_output, value, shapes, starts, loc, attn)
    assert longest, "the rule sorted the lists"
    return listed, longest[0]
