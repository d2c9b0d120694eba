"""The softmax operators (msda::forward_softmax / msda::backward_softmax and
msda.multi_scale_deformable_attention_softmax): attention logits, normalized over the L * K
samples of each (batch, query, head) inside the operator.

Against the float64 oracle (msda.testing.reference_softmax: torch.softmax of the logits in
float64, then the reference) for the output and the three gradients, in every dtype, on the
pure-PyTorch path and through the Triton kernels (Triton's interpreter on a CPU-only machine,
compiled on CUDA where a GPU is present), at several launch tiles; the non-finite logits of
docs/contract.md; gradcheck; the bad-input battery through the three softmax entry points; and the
layer's fused and unfused forms against each other. opcheck, torch.compile and export are in
tests/test_opcheck.py and tests/test_compile_export.py.
"""

from __future__ import annotations

import math
import os
import re
from unittest import mock

import pytest
import torch

import msda
from msda import ops, torch_impl
from msda.kernels import backward as backward_kernel
from msda.kernels import forward as forward_kernel
from msda.kernels import launch
from msda.testing import TOLERANCE, Inputs, Shape, make_inputs, reference_softmax, relative_error
from msda.testing_cases import BAD_CALLS, FORWARD_ARGS, BadCall, valid_args

from .helpers import assert_matches_reference, forward_backward, random_like_output
from .test_edge_cases import backend
from .test_triton_kernels import SHAPE, SPARSE, TILES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="no interpreter and no GPU"),
]
# The torch path on CPU; the Triton kernels on CUDA, or in the interpreter on CPU.
PATHS = [
    pytest.param("torch", "cpu", id="torch"),
    pytest.param("triton", DEVICE, id="kernels", marks=needs_kernels),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

fused = msda.multi_scale_deformable_attention_softmax


@pytest.fixture(autouse=True)
def fused_kernels_in_the_interpreter(monkeypatch):
    """The interpreter tests the kernels' own softmax (launch.FUSED_SOFTMAX, off by default: slower
    on the H200), so that the fused code stays right; on a GPU the tests run what users get, and
    tests/gpu/test_gpu_softmax.py tests both forms."""
    if INTERPRETER:
        monkeypatch.setattr(launch, "FUSED_SOFTMAX", True)


def check(inputs: Inputs, **kwargs) -> dict[str, float]:
    """The functional softmax form's output and gradients (through autograd) against the oracle."""
    grad_output = random_like_output(inputs)
    results = forward_backward(inputs, grad_output, fn=fused)
    return assert_matches_reference(inputs, results, grad_output, softmax=True, **kwargs)


def logit_inputs(shape: Shape, dtype: torch.dtype, device, **kwargs) -> Inputs:
    """make_inputs with logits in place of the weights, spread wider than N(0, 1) (x 3): uneven
    weights, some of them tiny."""
    inputs = make_inputs(shape, dtype, device, logits=True, **kwargs)
    inputs.attention_weights = (3 * inputs.attention_weights.float()).to(inputs.attention_weights.dtype)
    return inputs


# --- Against the oracle -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path,device", PATHS)
def test_forward_and_backward(path, device, dtype):
    with backend(path):
        check(logit_inputs(SHAPE, dtype, device, outside_fraction=0.25, seed=51))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path,device", PATHS)
def test_mixed_precision(path, device, dtype):
    """A half-precision value with float32 locations and logits."""
    with backend(path):
        check(logit_inputs(SHAPE, dtype, device, loc_dtype=torch.float32, seed=52))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path,device", PATHS)
def test_sparse_samples(path, device, dtype):
    """Few samples per value row: where the rule picks native half atomics for grad_value."""
    with backend(path):
        check(logit_inputs(SPARSE, dtype, device, seed=53))


@pytest.mark.parametrize("path,device", PATHS)
def test_local_distribution(path, device):
    shape = Shape(batch=1, queries=28, heads=2, head_dim=4, levels=((4, 5), (2, 3), (1, 2)), points=2)
    with backend(path):
        check(logit_inputs(shape, torch.float32, device, dist="local", seed=54))


@pytest.mark.parametrize("shape", [
    Shape(batch=1, queries=3, heads=2, head_dim=4, levels=((3, 4),), points=1),  # L * K = 1: weight 1
    Shape(batch=1, queries=3, heads=1, head_dim=8, levels=((3, 4), (2, 2), (1, 1)), points=9),  # L * K = 27
    Shape(batch=1, queries=20, heads=1, head_dim=3, levels=((3, 4), (2, 2)), points=3),  # > one query block
], ids=["LK1", "LK27", "queries20"])
@pytest.mark.parametrize("path,device", PATHS)
def test_row_lengths(path, device, shape):
    """Softmax rows of one logit, of more than the unrolled points (K = 9: a loop of unrolled
    steps, some groups masked), and query blocks cut at the end."""
    with backend(path):
        check(logit_inputs(shape, torch.float32, device, outside_fraction=0.2, seed=55))


@pytest.mark.interpreter
@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="no interpreter and no GPU")
def test_launch_settings(monkeypatch, tile):
    """Every launch setting computes the same, forward and backward (the softmax statistics are
    reduced over the thread groups of the tile)."""
    monkeypatch.setattr(launch, "forward_config", lambda *args: tile)
    monkeypatch.setattr(launch, "backward_config", lambda *args: tile)
    with backend("triton"):
        check(logit_inputs(SHAPE, torch.float32, DEVICE, outside_fraction=0.25, seed=56))


def _kernel_results(inputs: Inputs, grad_output, starts, scratch_in_output: bool):
    """Both kernels launched directly with softmax=True: (out, grad_value, grad_loc, grad_logits)."""
    value, shapes, _, loc, logits = inputs.args()
    out = torch.empty_like(grad_output)
    grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, logits, out, softmax=True)
    forward_kernel.msda_forward_kernel[grid](*args, **constexprs)
    grads = [torch.zeros_like(value), torch.empty_like(loc), torch.empty_like(logits)]
    scratch = grads[2] if scratch_in_output else torch.empty_like(logits)
    grid, args, constexprs = launch.backward_call(
        grad_output, value, shapes, starts, loc, logits, *grads, softmax=True, scratch=scratch
    )
    backward_kernel.msda_backward_kernel[grid](*args, **constexprs)
    return (out, *grads)


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETER, reason="the interpreter's programs run in order: bitwise repeatable atomics")
def test_scratch_in_the_output_and_level_starts_summed_in_kernel():
    """The backward's scratch may be grad_logits itself (the eager fast path's float32 case): the
    same results, bit for bit, as with a scratch of its own (the registered operator's), and with
    the level starts summed in the kernel (level_start_index=None on the eager path)."""
    inputs = logit_inputs(SHAPE, torch.float32, DEVICE, outside_fraction=0.25, seed=57)
    grad_output = random_like_output(inputs)
    separate = _kernel_results(inputs, grad_output, inputs.level_start_index, scratch_in_output=False)
    for starts in (inputs.level_start_index, None):
        in_output = _kernel_results(inputs, grad_output, starts, scratch_in_output=True)
        for a, b in zip(in_output, separate):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_matches_reference(inputs, separate, grad_output, softmax=True)


def test_gradcheck():
    shape = Shape(batch=1, queries=3, heads=2, head_dim=3, levels=((3, 4), (2, 2)), points=2)
    inputs = logit_inputs(shape, torch.float64, "cpu", outside_fraction=0.2, seed=58, requires_grad=True)
    with backend("torch"):
        assert torch.autograd.gradcheck(fused, inputs.args(), eps=1e-6, atol=1e-7)


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRETER or torch.cuda.is_available()), reason="no interpreter and no GPU")
def test_gradcheck_kernels():
    """Through the Triton kernels in float64 (gradcheck's fast mode: a few random directions,
    which keeps the interpreter's share small)."""
    shape = Shape(batch=1, queries=3, heads=2, head_dim=3, levels=((3, 4), (2, 2)), points=2)
    inputs = logit_inputs(shape, torch.float64, DEVICE, outside_fraction=0.2, seed=59, requires_grad=True)
    with backend("triton"):
        assert torch.autograd.gradcheck(fused, inputs.args(), eps=1e-6, atol=1e-7, fast_mode=True)


def test_same_as_a_separate_softmax():
    """The fused form equals the softmax followed by the plain operator (float64: to rounding)."""
    inputs = logit_inputs(SHAPE, torch.float64, "cpu", outside_fraction=0.2, seed=60)
    value, shapes, starts, loc, logits = inputs.args()
    weights = logits.flatten(-2).softmax(-1).view(logits.shape)
    expected = msda.multi_scale_deformable_attention(value, shapes, starts, loc, weights)
    assert relative_error(fused(value, shapes, None, loc, logits), expected) <= TOLERANCE[torch.float64]


# --- Non-finite logits --------------------------------------------------------------------------


def _non_finite_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, nan_heads): per (batch, query, head), in turn: finite; one -inf logit; all but one
    -inf; all -inf; one +inf; one NaN. nan_heads marks the heads whose weights are NaN (torch.softmax:
    all -inf, +inf, NaN)."""
    B, Q, M, L, K = logits.shape
    rows = logits.detach().clone().view(B * Q * M, L * K)
    nan_heads = torch.zeros(B * Q * M, dtype=torch.bool)
    for row in range(B * Q * M):
        kind = row % 6
        if kind == 1:
            rows[row, row % (L * K)] = -math.inf
        elif kind == 2:
            rows[row, 1:] = -math.inf
        elif kind == 3:
            rows[row] = -math.inf
        elif kind == 4:
            rows[row, 0] = math.inf
        elif kind == 5:
            rows[row, -1] = math.nan
        nan_heads[row] = kind >= 3
    return rows.view(logits.shape), nan_heads.view(B, Q, M)


def _close_where_finite(actual, expected, finite, bound, what):
    assert torch.isfinite(actual[finite]).all(), f"{what}: non-finite where the oracle is finite"
    assert torch.isnan(actual[~finite]).all(), f"{what}: finite where the oracle is NaN"
    error = relative_error(actual[finite], expected[finite])
    assert error <= bound, f"{what}: relative error {error:.2e} > {bound:.0e}"


# The interpreter computes -inf - -inf and inf - inf in numpy, which warns: the NaN is the point.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("path,device", PATHS)
def test_non_finite_logits(path, device):
    """torch.softmax's semantics (docs/contract.md): a -inf logit gets weight 0 (and a zero
    gradient); a head whose logits are all -inf, or include +inf or NaN, gets NaN weights, so its
    output and its logits' and locations' gradients are NaN; every other head is as the float64
    oracle says."""
    shape = Shape(batch=2, queries=3, heads=2, head_dim=4, levels=((3, 4), (2, 2)), points=2)
    inputs = logit_inputs(shape, torch.float32, device, outside_fraction=0.2, seed=61)
    logits, nan_heads = _non_finite_logits(inputs.attention_weights.cpu())
    inputs.attention_weights = logits.to(device)
    grad_output = random_like_output(inputs)
    with backend(path):
        out, grad_value, grad_loc, grad_logits = forward_backward(inputs, grad_output, fn=fused)

    value64, loc64, logits64 = (
        t.detach().cpu().double().requires_grad_()
        for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    )
    expected = reference_softmax(value64, inputs.spatial_shapes.cpu(), loc64, logits64)
    expected.backward(grad_output.cpu().double())

    bound = TOLERANCE[torch.float32]
    B, Q, M, L, K = logits.shape
    D = shape.head_dim
    finite_out = ~nan_heads[..., None].expand(B, Q, M, D).reshape(B, Q, M * D)
    _close_where_finite(out.cpu(), expected.detach(), finite_out, bound, "output")
    finite_params = ~nan_heads[..., None, None].expand(B, Q, M, L, K)
    _close_where_finite(grad_logits.cpu(), logits64.grad, finite_params, bound, "grad_attention_logits")
    _close_where_finite(grad_loc.cpu(), loc64.grad, finite_params[..., None].expand_as(loc64), bound, "grad_loc")
    assert torch.count_nonzero(grad_logits.cpu()[torch.isneginf(logits) & finite_params]) == 0
    assert torch.isnan(grad_value).any()  # the NaN heads' samples scatter NaN: not hidden


# --- Bad input ----------------------------------------------------------------------------------

SOFTMAX_ENTRY_POINTS = {"functional": "functional", "forward": "forward_softmax", "backward": "backward_softmax"}


def _call_softmax(entry: str, args: dict):
    forward_args = [args[name] for name in FORWARD_ARGS]
    if entry == "functional":
        return fused(*forward_args)
    if entry == "forward_softmax":
        return torch.ops.msda.forward_softmax(*forward_args)
    return torch.ops.msda.backward_softmax(args["grad_output"], *forward_args)


SOFTMAX_BATTERY = [
    pytest.param(case, SOFTMAX_ENTRY_POINTS[entry], id=f"{SOFTMAX_ENTRY_POINTS[entry]}-{case.id}")
    for case in BAD_CALLS
    for entry in case.entries
    if entry == "functional" or not case.dispatcher_rejects
]


def assert_softmax_call_rejected(case: BadCall, entry: str, args: dict) -> None:
    """The call raises case.error naming case.argument, attention_logits for attention_weights."""
    argument = "attention_logits" if case.argument == "attention_weights" else case.argument
    with pytest.raises((ValueError, TypeError)) as info:
        _call_softmax(entry, case.edit(args))
    message = str(info.value)
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {message}"
    assert re.search(rf"\b{argument}\b", message), f"message does not name {argument}: {message}"
    assert "attention_weights" not in message, message


@pytest.mark.parametrize("case,entry", SOFTMAX_BATTERY)
def test_bad_call_raises_naming_the_argument(case: BadCall, entry: str):
    """The bad-input battery (msda.testing_cases.BAD_CALLS) through the softmax entry points:
    the same errors, the last argument named attention_logits."""
    with backend("torch"):
        assert_softmax_call_rejected(case, entry, valid_args())


def test_all_meta_is_valid():
    args = {name: t.to("meta") for name, t in valid_args().items()}
    assert _call_softmax("forward_softmax", args).shape == (2, 3, 8)
    grads = _call_softmax("backward_softmax", args)
    assert [g.shape for g in grads] == [(2, 16, 2, 4), (2, 3, 2, 2, 2, 2), (2, 3, 2, 2, 2)]


@pytest.mark.parametrize("mode", ["default", "deterministic"])
@pytest.mark.parametrize("path,device", PATHS)
def test_deterministic_mode_sums_deterministically(path, device, mode, request):
    """As msda::backward: under torch.use_deterministic_algorithms(True) the kernels sum grad_value
    without float atomics (tests/test_deterministic.py): from the lists of samples where the softmax
    runs outside the kernels (launch.FUSED_SOFTMAX False; sorted and summed in float32 at this
    decoder shape), with 64-bit fixed-point atomics inside them; the pure-PyTorch path is
    deterministic anyway."""
    if mode == "deterministic":
        request.getfixturevalue("deterministic_algorithms")
    inputs = logit_inputs(Shape(1, 5, 2, 4, ((3, 4), (2, 2)), 2), torch.float32, device, seed=62)
    with (
        backend(path),
        mock.patch.object(torch_impl, "backward_softmax", wraps=torch_impl.backward_softmax) as pure_pytorch,
        mock.patch.object(backward_kernel, "from_fixed_point", wraps=backward_kernel.from_fixed_point) as atomics,
        mock.patch.object(launch, "deterministic_grad_value", wraps=launch.deterministic_grad_value) as lists,
    ):
        check(inputs)
    assert pure_pytorch.call_count == (1 if path == "torch" else 0)
    fixed_point = mode == "deterministic" and path != "torch"
    fused_in_kernel = launch.FUSED_SOFTMAX
    expected = (fixed_point and fused_in_kernel, fixed_point and not fused_in_kernel)
    assert (atomics.call_count, lists.call_count) == expected


# --- The layer ----------------------------------------------------------------------------------


def _layer_inputs(batch=2, queries=7, d_model=32, levels=((6, 8), (3, 4)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels)
    tokens = int(shapes.prod(1).sum())
    return dict(
        query=torch.randn(batch, queries, d_model, generator=gen),
        reference_points=torch.rand(batch, queries, len(levels), 2, generator=gen),
        input_flatten=torch.randn(batch, tokens, d_model, generator=gen),
        input_spatial_shapes=shapes,
        input_level_start_index=None,
    )


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_layer_fused_and_unfused_agree(path):
    """fused_softmax=True (the default) and False: the same state_dict, the same output and
    gradients within the float32 bound."""
    fused_layer = msda.MultiScaleDeformableAttention(32, 2, 4, 3)
    assert fused_layer.fused_softmax and "fused_softmax=True" in repr(fused_layer)
    with torch.no_grad():  # uneven attention: the original init zeroes the weights' projection
        fused_layer.attention_weights.weight.normal_(std=0.3)
    unfused_layer = msda.MultiScaleDeformableAttention(32, 2, 4, 3, fused_softmax=False)
    unfused_layer.load_state_dict(fused_layer.state_dict())  # strict: the same keys
    inputs = {k: v if v is None else v.to(DEVICE if path == "triton" else "cpu") for k, v in _layer_inputs().items()}
    fused_layer.to(inputs["query"].device)
    unfused_layer.to(inputs["query"].device)
    results = []
    with backend(path):
        for layer in (fused_layer, unfused_layer):
            out = layer(**inputs)
            grads = torch.autograd.grad(out, list(layer.parameters()), torch.ones_like(out))
            results.append((out, grads))
    (out_f, grads_f), (out_u, grads_u) = results
    assert relative_error(out_f, out_u) <= TOLERANCE[torch.float32]
    for (name, _), g_f, g_u in zip(fused_layer.named_parameters(), grads_f, grads_u):
        assert relative_error(g_f, g_u) <= TOLERANCE[torch.float32], name
