"""Deterministic mode (docs/contract.md): under torch.use_deterministic_algorithms(True) the Triton
backward sums each grad_value row once from a list of the samples on it (kernels/deterministic.py):
an encoder's in 64-bit fixed point (integers: the same bits in any order), a decoder's in float32
over its lists sorted first (launch.list_rule; the fused-softmax kernels add fixed-point integers
with atomics instead); float64 takes the pure-PyTorch backward, whose scatter is deterministic in
that mode. On CPU this runs through the Triton backend (the interpreter);
tests/gpu checks on CUDA that the gradients are bitwise equal run to run, compiled and in CUDA
graphs too."""

import math
from unittest import mock

import pytest
import torch

from msda import torch_impl
from msda.kernels import backward as backward_kernel
from msda.kernels import launch
from msda.testing import Shape, make_inputs, reference_with_grads, relative_error, tolerance

from .helpers import (
    assert_matches_reference,
    atomic_fixed_point_grad_value,
    forward_backward,
    listed_grad_value,
    random_like_output,
    sorted_lists_grad_value,
)
from .test_edge_cases import backend, needs_interpreter

SHAPE = Shape(1, 5, 2, 4, ((3, 4), (2, 2)), 2)


def interpreted(test):
    for mark in needs_interpreter:
        test = mark(test)
    return test


@pytest.mark.parametrize("mode", ["default", "sorted lists", "fixed point"])
@interpreted
def test_deterministic_mode_sums_the_lists(mode, request, monkeypatch):
    """Each way of summing: the default atomics, and in deterministic mode the lists sorted and
    summed in float32 (SHAPE is a decoder's, Q != S: the rule's choice) or in fixed point (forced
    here; an encoder's by the rule), both within the bounds. Run to run the interpreter runs the
    programs in one order, so the repeat checks only that nothing else varies (tests/gpu checks
    the bits on CUDA)."""
    inputs = make_inputs(SHAPE, seed=6)
    assert launch.list_rule(inputs.sampling_locations.shape[1], inputs.value.shape[1], inputs.value).sorted_sums
    if mode != "default":
        request.getfixturevalue("deterministic_algorithms")
        monkeypatch.setattr(launch, "LIST_SORTED", mode == "sorted lists")
    grad_output = random_like_output(inputs)
    with (
        backend("triton"),
        mock.patch.object(torch_impl, "backward", wraps=torch_impl.backward) as pure_pytorch,
        mock.patch.object(launch, "deterministic_grad_value", wraps=launch.deterministic_grad_value) as lists,
        mock.patch.object(launch, "fixed_point_scales", wraps=launch.fixed_point_scales) as fixed_point,
    ):
        results = forward_backward(inputs, grad_output)
        again = forward_backward(inputs, grad_output)
    assert pure_pytorch.call_count == 0
    assert lists.call_count == (0 if mode == "default" else 2)
    assert fixed_point.call_count == (2 if mode == "fixed point" else 0)
    assert_matches_reference(inputs, results, grad_output)
    for a, b in zip(results, again):
        assert torch.equal(a, b)


@interpreted
def test_float64_deterministic_takes_the_pure_pytorch_backward(deterministic_algorithms):
    inputs = make_inputs(SHAPE, torch.float64, seed=6)
    grad_output = random_like_output(inputs)
    with backend("triton"), mock.patch.object(torch_impl, "backward", wraps=torch_impl.backward) as spy:
        results = forward_backward(inputs, grad_output)
    assert spy.call_count == 1
    assert_matches_reference(inputs, results, grad_output)


@interpreted
@pytest.mark.parametrize("where", ["grad_output", "attention_weights"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("queries, forced", [(5, None), (16, None), (5, False)],
                         ids=["decoder", "encoder", "decoder-fixed-point"])  # fmt: skip
def test_non_finite_input_in_grad_value(monkeypatch, deterministic_algorithms, where, bad, queries, forced):
    """docs/contract.md: a non-finite grad_output or attention weight anywhere makes every
    grad_value element NaN where the lists are summed in fixed point (an encoder's, by the rule:
    integers carry no inf or NaN); where they are sorted and summed in float32 (a decoder's), it
    reaches the rows the default mode's does."""
    monkeypatch.setattr(launch, "LIST_SORTED", forced)
    shape = Shape(1, queries, 2, 4, ((3, 4), (2, 2)), 2)  # S = 16: queries == 16 is an encoder
    inputs = make_inputs(shape, seed=7)
    sorted_lists = launch.list_rule(queries, shape.num_values, inputs.value).sorted_sums
    assert sorted_lists == (queries == 5 and forced is None)
    grad_output = random_like_output(inputs)
    if where == "grad_output":
        grad_output[0, 1, 3] = bad
    else:
        inputs.attention_weights[0, 1, 1, 0, 1] = bad
    with backend("triton"):
        _, grad_value, _, _ = forward_backward(inputs, grad_output)
        torch.use_deterministic_algorithms(False)
        _, default, _, _ = forward_backward(inputs, grad_output)
    if not sorted_lists:
        assert grad_value.isnan().all()
    else:
        assert default.isfinite().any() and not default.isfinite().all()
        assert torch.equal(grad_value.isfinite(), default.isfinite())


@pytest.mark.parametrize("largest", [0.0, 1e-30, 3e-5, 1.0, 7.5e3, 3e30])
def test_fixed_point_scale_keeps_every_sum_below_2_to_62(largest):
    """The scale is a power of two, and samples_per_row contributions of the largest size, times
    it, stay below 2**62 (no int64 overflow) while using most of the range."""
    grad_output = torch.full((2, 3, 4), largest)
    weights = torch.full((2, 3, 5), 0.5)
    samples = 1000
    scale = backward_kernel.fixed_point_scale(grad_output, weights, samples).item()
    assert math.frexp(scale)[0] == 0.5  # a power of two
    bound = largest * 0.5 * samples
    assert bound * scale < 2.0**62
    if 2.0**-60 < bound < 2.0**60:
        assert bound * scale >= 2.0**61


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_fixed_point_scale_is_nan_for_non_finite_inputs(bad):
    grad_output = torch.ones(2, 3, 4)
    weights = torch.ones(2, 3, 5)
    weights[1, 2, 0] = bad
    assert math.isnan(backward_kernel.fixed_point_scale(grad_output, weights, 10).item())
    assert math.isnan(backward_kernel.fixed_point_scale(weights, None, 10).item())


@pytest.mark.parametrize("largest", [0.0, 1e-41, 1e-30, 3e-5, 1.0, 7.5e3, 3e30, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@interpreted
def test_fixed_point_scale_kernel_gives_the_pytorch_scale(largest, dtype):
    """The lists' scale kernel gives backward.fixed_point_scale's 2**e, and 2**-e, to the bit:
    zero, subnormal, normal and non-finite bounds, half-precision inputs, a grad_output whose
    batches are not Q rows apart, and more than one program (the last one finishes the scale)."""
    grad_output = torch.rand(2, 3, 8, dtype=torch.float64) * min(abs(largest), 1.0) * (largest == largest)
    grad_output[1, 2, 5] = largest
    grad_output = torch.cat([grad_output, grad_output[:, :1]], dim=1)[:, :-1].to(dtype)
    weights = torch.rand(2, 3, 4, launch.SCALE_BLOCK // 4 + 1).to(dtype)
    samples = 3 * 7

    def run(kernel, grid, args, constexprs):
        assert grid[0] > 1
        kernel[grid](*args, **constexprs)

    scales = launch.fixed_point_scales(run, grad_output, weights, samples, torch.zeros(3, dtype=torch.int32))
    expected = backward_kernel.fixed_point_scale(grad_output, weights, samples)
    if expected.isfinite().all():
        assert torch.equal(scales, torch.cat([expected, expected.reciprocal()]))
    else:
        assert scales.isnan().all()


@pytest.mark.parametrize(
    "dtype, rows, entries, warps, joined, queries, head_dim",
    [(torch.float32, None, None, None, None, 7, 6), (torch.float16, None, None, None, None, 7, 6),
     (torch.float32, None, None, None, None, 17, 6), (torch.float16, None, None, None, None, 17, 6),
     (torch.float32, 1, 2, None, False, 7, 6), (torch.float16, 16, 4, 1, False, 7, 6),
     (torch.float16, None, None, None, None, 17, 8), (torch.float32, 2, 1, None, False, 7, 6),
     (torch.float32, 2, 1, None, True, 17, 6)],
    ids=["float32-rule", "float16-rule", "float32-rule-encoder", "float16-rule-encoder", "float32-1x2",
         "float16-16x4-one-warp", "float16-rule-encoder-aligned-rows", "float32-2x1-side-by-side",
         "float32-2x1-joined-encoder"],
)  # fmt: skip
@interpreted
def test_lists_sum_the_bits_of_the_atomic_fixed_point_path(monkeypatch, dtype, rows, entries, warps, joined,
                                                           queries, head_dim):  # fmt: skip
    """grad_value summed from the lists of samples equals, bit for bit, the backward kernel's 64-bit
    atomic adds of the same fixed-point contributions (the path the fused-softmax kernels keep),
    with samples outside the levels and straddling their borders, and a level of one pixel; at
    the rule's gather tile (a decoder's, and an encoder's: every pixel a query) and at others
    (lists longer than a step, a program's rows past the last row, fewer warps than rows, a
    row's two runs joined or side by side). A decoder's lists are summed so only if not sorted
    (the rule sorts them: `test_sorted_lists_sum_the_same_bits_in_any_slot_order`)."""
    monkeypatch.setattr(launch, "LIST_SORTED", False)
    if rows is not None:
        monkeypatch.setattr(launch, "LIST_ROWS", rows)
        monkeypatch.setattr(launch, "LIST_ENTRIES", entries)
        monkeypatch.setattr(launch, "LIST_WARPS", warps)
        monkeypatch.setattr(launch, "LIST_JOINED", joined)
    shape = Shape(2, queries, 2, head_dim, ((3, 4), (2, 2), (1, 1)), 3)
    assert launch.every_pixel_a_query(queries, shape.num_values) == (queries == 17)
    inputs = make_inputs(shape, dtype, outside_fraction=0.25, seed=8)
    grad_output = random_like_output(inputs)
    value, shapes, starts, loc, attn = inputs.args()
    atomic = atomic_fixed_point_grad_value(grad_output, value, shapes, starts, loc, attn)

    launched = []  # each launch's constexprs: the gather's last

    def run(kernel, grid, args, constexprs):
        launched.append(constexprs)
        kernel[grid](*args, **constexprs)

    # grad_output's batches a query apart (a slice of a longer one): the gather's other addressing.
    padded = torch.cat([grad_output, grad_output[:, :1]], dim=1)[:, :-1]
    assert padded.stride(0) != padded.shape[1] * padded.stride(1) and torch.equal(padded, grad_output)
    for given, grad in ((starts, grad_output), (None, grad_output), (starts, padded)):  # level starts summed too
        listed = listed_grad_value(run, grad, value, shapes, given, loc, attn)
        assert listed.dtype == dtype and torch.equal(listed, atomic)
    assert atomic.abs().sum() > 0
    gather = launched[-1]
    assert gather["ROWS_ALIGNED"] == (head_dim == 8)  # grad_output's rows start at multiples of 16 elements
    assert gather["JOINED"] == (joined if joined is not None else queries == 7)  # the rule's: decoders

    # Level starts that make levels overlap (not checked on CUDA): a row then takes the corners
    # of every level holding it, as the atomics add them.
    overlapping = torch.tensor([0, 2, 5], dtype=starts.dtype)
    atomic = atomic_fixed_point_grad_value(grad_output, value, shapes, overlapping, loc, attn)
    listed = listed_grad_value(run, grad_output, value, shapes, overlapping, loc, attn)
    assert torch.equal(listed, atomic) and atomic[:, 2:6].abs().sum() > 0


@pytest.mark.parametrize("dtype, joined", [(torch.float32, None), (torch.float16, None), (torch.float32, False)],
                         ids=["float32-rule", "float16-rule", "float32-side-by-side"])  # fmt: skip
@interpreted
def test_sorted_lists_sum_the_same_bits_in_any_slot_order(monkeypatch, dtype, joined):
    """The lists sorted (a decoder's, by the rule) and summed in float32 give the same bits
    whatever order the lists' slots were taken in (shuffled here: on a GPU the atomics decide
    it), with level starts given or summed, within the float64 oracle's bound; with a list longer
    than the sort kernel's step (a 1 x 1 level under every query), and a row's runs side by side."""
    shape = Shape(2, 7, 2, 6, ((3, 4), (2, 2), (1, 1)), 3)
    inputs = make_inputs(shape, dtype, outside_fraction=0.25, seed=9)
    grad_output = random_like_output(inputs)
    value, shapes, starts, loc, attn = inputs.args()
    assert launch.list_rule(7, shape.num_values, value).sorted_sums  # a decoder: the rule sorts
    monkeypatch.setattr(launch, "LIST_JOINED", joined)
    first, longest = sorted_lists_grad_value(grad_output, value, shapes, starts, loc, attn)
    assert longest > launch.SORT_AHEAD
    for seed, given in ((1, starts), (2, None)):
        again, _ = sorted_lists_grad_value(grad_output, value, shapes, given, loc, attn, seed)
        assert torch.equal(again, first)
    assert relative_error(first, reference_with_grads(inputs, grad_output)[1]) <= tolerance(dtype)


def test_fill_skipped_only_inside_and_only_when_asked(deterministic_algorithms):
    """The deterministic mode's NaN fill of torch.empty is off inside `fill_skipped` (buffers the
    kernels write whole) and back on after it, an exception included; `skip=False` keeps it;
    `empty_written_whole` allocates inside it."""
    flag = torch.utils.deterministic
    assert flag.fill_uninitialized_memory
    with launch.fill_skipped(False):
        assert flag.fill_uninitialized_memory and torch.empty(4).isnan().all()
    with pytest.raises(RuntimeError), launch.fill_skipped():
        assert not flag.fill_uninitialized_memory
        raise RuntimeError
    assert flag.fill_uninitialized_memory and torch.empty(4).isnan().all()
    # Outputs the kernels write whole allocate with the fill off, and leave it on.
    fill_on_allocation = []

    def spy(*args, **kwargs):
        fill_on_allocation.append(flag.fill_uninitialized_memory)
        return real_empty(*args, **kwargs)

    real_empty = torch.empty
    with mock.patch.object(torch, "empty", spy):
        out = launch.empty_written_whole((2, 3), torch.float16, "cpu")
    assert fill_on_allocation == [False] and flag.fill_uninitialized_memory
    assert out.shape == (2, 3) and out.dtype == torch.float16


def test_new_empty_written_whole(deterministic_algorithms):
    """The eager path's outputs (`new_empty_written_whole`): contiguous, of the given shape or the
    argument's, with its dtype and device, allocated with the deterministic mode's NaN fill off,
    which stays on after."""
    flag = torch.utils.deterministic
    fill_on_allocation = []
    real_empty_like, real_new_empty = torch.empty_like, torch.Tensor.new_empty

    def empty_like(*args, **kwargs):
        fill_on_allocation.append(flag.fill_uninitialized_memory)
        return real_empty_like(*args, **kwargs)

    def new_empty(self, *args, **kwargs):
        fill_on_allocation.append(flag.fill_uninitialized_memory)
        return real_new_empty(self, *args, **kwargs)

    source = torch.ones(3, 4, dtype=torch.float16).t()  # not contiguous
    with mock.patch.object(torch, "empty_like", empty_like), mock.patch.object(torch.Tensor, "new_empty", new_empty):
        alike = launch.new_empty_written_whole(source)
        shaped = launch.new_empty_written_whole(source, (2, 5))
    assert fill_on_allocation == [False, False] and flag.fill_uninitialized_memory
    assert alike.shape == (4, 3) and shaped.shape == (2, 5)
    for out in (alike, shaped):
        assert out.is_contiguous() and out.dtype == torch.float16 and out.device == source.device
