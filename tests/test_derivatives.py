"""Derivatives beyond the first backward (issue 15, items 2 and 3), against the float64 oracle
(msda.testing.reference, differentiated by autograd) and finite differences:

- double backward: msda::backward has an autograd formula (msda/derivatives.py), so gradient
  penalties and Hessian-vector products work; torch.autograd.gradgradcheck passes in float64;
- forward mode: msda.derivatives.forward_jvp is the jvp of the output; inside an
  autograd.Function's jvp it serves torch.func.jvp, jacfwd and torch.autograd.forward_ad;
- the bare operator under forward-mode AD raises an error naming msda (PyTorch would return zero
  tangents for it).

Samples sit away from pixel borders, where bilinear interpolation has kinks and finite
differences disagree with the one-sided derivatives; some lie outside their level, on and
across its edge, some far outside.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import msda
from msda import derivatives, torch_impl
from msda.testing import Inputs, Shape, reference, reference_with_grads, relative_error, tolerance

from .test_edge_cases import backend, needs_interpreter

PATHS = ["torch", pytest.param("triton", marks=needs_interpreter)]
NO_FORWARD_AD = r"msda: torch\.ops\.msda\.{op} has no forward-mode AD"
SHAPE = Shape(batch=2, queries=3, heads=2, head_dim=3, levels=((3, 4), (2, 3), (1, 1)), points=2)
SMALL = Shape(batch=1, queries=2, heads=2, head_dim=2, levels=((3, 4), (2, 2)), points=2)


def smooth_inputs(shape: Shape, dtype=torch.float64, device="cpu", seed=0, far_fraction=0.15) -> Inputs:
    """Inputs whose samples have x_im and y_im at least 0.15 pixel from an integer (a cell
    border, where the derivatives jump), in cells -1 .. W-1 (so some straddle a level's edge),
    and `far_fraction` of them far outside (-3). Weights are not normalized (any real is valid)."""
    gen = torch.Generator().manual_seed(seed)
    B, Q, M, D, K = shape.batch, shape.queries, shape.heads, shape.head_dim, shape.points
    L = len(shape.levels)
    shapes = torch.tensor(shape.levels, dtype=torch.int64)
    sizes = shapes.prod(1)
    wh = shapes.flip(1).to(torch.float64).view(1, 1, 1, L, 1, 2)  # (W, H)
    cell = torch.floor(torch.rand(B, Q, M, L, K, 2, generator=gen, dtype=torch.float64) * (wh + 1)) - 1
    fraction = 0.15 + 0.7 * torch.rand(B, Q, M, L, K, 2, generator=gen, dtype=torch.float64)
    loc = (cell + fraction + 0.5) / wh
    far = torch.rand(B, Q, M, L, K, 1, generator=gen) < far_fraction
    loc = torch.where(far, -3.0, loc)
    value = torch.randn(B, shape.num_values, M, D, generator=gen, dtype=torch.float64)
    attn = torch.randn(B, Q, M, L, K, generator=gen, dtype=torch.float64)
    return Inputs(
        value=value.to(device, dtype),
        spatial_shapes=shapes.to(device),
        level_start_index=(sizes.cumsum(0) - sizes).to(device),
        sampling_locations=loc.to(device, dtype),
        attention_weights=attn.to(device, dtype),
    )


def leaves(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(
        t.detach().clone().requires_grad_()
        for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    )


def tangents(inputs: Inputs, seed=1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype)
        for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    )


def msda_of(inputs: Inputs):
    return lambda value, loc, attn: msda.multi_scale_deformable_attention(
        value, inputs.spatial_shapes, inputs.level_start_index, loc, attn
    )


def oracle_of(inputs: Inputs):
    return lambda value, loc, attn: reference(value, inputs.spatial_shapes, loc, attn)


# ---------------------------------------------------------------------------------------------
# Double backward


@pytest.mark.parametrize("shape", [SHAPE, SMALL], ids=["three-levels", "small"])
def test_gradgradcheck_torch_path(shape):
    inputs = smooth_inputs(shape)
    with backend("torch"):
        assert torch.autograd.gradgradcheck(msda_of(inputs), leaves(inputs))


def second_order_terms(fn, inputs: Inputs) -> dict[str, torch.Tensor]:
    """A gradient penalty's gradients: P = <r_v, dF/dv> + <r_l, dF/dloc> + <r_a, dF/dattn> with
    F = <c, fn(...)>, differentiated in the inputs and in c (what gradient penalties and
    Hessian-vector products need, every term of the backward's derivative)."""
    value, loc, attn = leaves(inputs)
    gen = torch.Generator().manual_seed(7)
    out_shape = (value.shape[0], loc.shape[1], value.shape[2] * value.shape[3])
    c = torch.randn(out_shape, generator=gen, dtype=torch.float64).to(value.device, value.dtype).requires_grad_()
    r = tangents(inputs, seed=8)
    first = torch.autograd.grad(fn(value, loc, attn), (value, loc, attn), c, create_graph=True)
    penalty = sum((g * w).sum() for g, w in zip(first, r))
    names = ("value", "sampling_locations", "attention_weights", "grad_output")
    return dict(zip(names, torch.autograd.grad(penalty, (value, loc, attn, c))))


@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_the_oracle(path):
    inputs = smooth_inputs(SHAPE)
    expected = second_order_terms(oracle_of(inputs), inputs)
    with backend(path):
        actual = second_order_terms(msda_of(inputs), inputs)
    for name, want in expected.items():
        assert want.abs().max() > 0, name  # every term is exercised
        assert relative_error(actual[name], want) <= 1e-12, name


@pytest.mark.parametrize("path", PATHS)
def test_hessian_vector_product_in_the_locations(path):
    inputs = smooth_inputs(SHAPE, seed=3)
    value, attn = inputs.value, inputs.attention_weights
    u = tangents(inputs, seed=4)[1]

    def loss(fn):
        return lambda loc: fn(value, loc, attn).pow(2).sum()

    _, expected = torch.autograd.functional.hvp(loss(oracle_of(inputs)), inputs.sampling_locations, u)
    with backend(path):
        _, actual = torch.autograd.functional.hvp(loss(msda_of(inputs)), inputs.sampling_locations, u)
    assert relative_error(actual, expected) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gradient_penalty_in_lower_precision(dtype):
    """The double backward keeps each gradient in its input's dtype, within the dtype's bound of
    the oracle on the same (rounded) inputs."""
    inputs = Inputs(*(t.to(dtype) if t.is_floating_point() else t for t in smooth_inputs(SHAPE, seed=5).args()))
    inputs64 = Inputs(*(t.double() if t.is_floating_point() else t for t in inputs.args()))
    expected = second_order_terms(oracle_of(inputs64), inputs64)
    with backend("torch"):
        actual = second_order_terms(msda_of(inputs), inputs)
    for name, want in expected.items():
        assert actual[name].dtype == dtype, name
        assert relative_error(actual[name], want) <= tolerance(dtype), name


# ---------------------------------------------------------------------------------------------
# Forward mode


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_forward_jvp_matches_the_oracle(path, dtype):
    inputs64 = smooth_inputs(SHAPE, seed=11)
    inputs = Inputs(*(t.to(dtype) if t.is_floating_point() else t for t in inputs64.args()))
    primals = (inputs64.value, inputs64.sampling_locations, inputs64.attention_weights)
    tangent64 = tangents(inputs64, seed=12)
    _, expected = torch.autograd.functional.jvp(oracle_of(inputs64), primals, tangent64)
    with backend(path):
        actual = derivatives.forward_jvp(*inputs.args(), *(t.to(dtype) for t in tangent64))
        # Each tangent alone (None for the others): the three terms add up.
        parts = [
            derivatives.forward_jvp(*inputs.args(), *(t.to(dtype) if i == j else None for j, t in enumerate(tangent64)))
            for i in range(3)
        ]
    assert actual.dtype == dtype
    assert relative_error(actual, expected) <= tolerance(dtype)
    assert relative_error(sum(p.double() for p in parts), expected) <= tolerance(dtype)


def test_forward_jvp_matches_finite_differences():
    inputs = smooth_inputs(SHAPE, seed=13)
    direction = tangents(inputs, seed=14)
    eps = 1e-6
    with backend("torch"):
        f = msda_of(inputs)
        primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
        plus = f(*(p + eps * d for p, d in zip(primals, direction)))
        minus = f(*(p - eps * d for p, d in zip(primals, direction)))
        jvp = derivatives.forward_jvp(*inputs.args(), *direction)
    assert relative_error(jvp, (plus - minus) / (2 * eps)) <= 1e-8


def test_forward_jvp_with_no_tangent_is_zero():
    inputs = smooth_inputs(SMALL)
    out = derivatives.forward_jvp(*inputs.args(), None, None, None)
    assert out.shape == (1, 2, 4) and not out.any()


def with_jvp(inputs: Inputs):
    return lambda value, loc, attn: derivatives.OperatorWithJvp.apply(
        value, inputs.spatial_shapes, inputs.level_start_index, loc, attn
    )


@pytest.mark.parametrize("path", PATHS)
def test_torch_func_jvp_and_forward_ad_through_an_autograd_function(path):
    inputs = smooth_inputs(SMALL, seed=21)
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    direction = tangents(inputs, seed=22)
    _, expected = torch.autograd.functional.jvp(oracle_of(inputs), primals, direction)
    with backend(path):
        _, jvp = torch.func.jvp(with_jvp(inputs), primals, direction)
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, d) for p, d in zip(primals, direction)]
            dual_tangent = forward_ad.unpack_dual(with_jvp(inputs)(*duals)).tangent
    assert relative_error(jvp, expected) <= 1e-12
    assert relative_error(dual_tangent, expected) <= 1e-12


def test_torch_func_jacfwd_through_an_autograd_function():
    """jacfwd: forward_jvp under vmap (the operator's calls fall back to a loop over the batch;
    the pure-PyTorch path only, the interpreter would run 80 calls)."""
    inputs = smooth_inputs(SMALL, seed=23)
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    expected = torch.autograd.functional.jacobian(oracle_of(inputs), primals)
    with backend("torch"):
        jacobians = torch.func.jacfwd(with_jvp(inputs), argnums=(0, 1, 2))(*primals)
    for actual, want in zip(jacobians, expected):
        assert relative_error(actual, want) <= 1e-12


def test_forward_over_reverse_raises_naming_msda():
    """torch.func.hessian (jacfwd of jacrev) differentiates the backward operator in forward
    mode, which it has no formula for: msda's error, not zeros."""
    inputs = smooth_inputs(SMALL, seed=24)
    f = with_jvp(inputs)
    with backend("torch"), pytest.raises(RuntimeError, match=NO_FORWARD_AD.format(op="backward")):
        torch.func.hessian(lambda loc: f(inputs.value, loc, inputs.attention_weights).sum())(inputs.sampling_locations)


def test_torch_func_reverse_mode_transforms():
    """torch.func.grad, vmap of grad (per-sample gradients) and jacrev of jacrev over the
    functional form, which takes OperatorWithJvp under torch.func: its backward runs through
    BackwardWithDerivative, a Function torch.func accepts (the autograd torch.library generates for
    msda::backward is not one, and grad raised with it). Against the float64 oracle."""
    inputs = smooth_inputs(SHAPE, seed=25)
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)

    def loss(fn):
        return lambda value, loc, attn: fn(value, loc, attn).square().sum()

    def oracle_grads(*args):
        args = [a.detach().clone().requires_grad_() for a in args]
        return torch.autograd.grad(loss(oracle_of(inputs))(*args), args)

    with backend("torch"):
        grads = torch.func.grad(loss(msda_of(inputs)), argnums=(0, 1, 2))(*primals)
        for actual, want in zip(grads, oracle_grads(*primals)):
            assert relative_error(actual, want) <= 1e-12

        # Per-sample gradients: each batch element a call of its own, under vmap.
        def one(value, loc, attn):
            return loss(msda_of(inputs))(value[None], loc[None], attn[None])

        per_sample = torch.func.vmap(torch.func.grad(one, argnums=(0, 1, 2)))(*primals)
        for b in range(SHAPE.batch):
            want = oracle_grads(*(p[b : b + 1] for p in primals))
            for actual, expected in zip(per_sample, want):
                assert relative_error(actual[b : b + 1], expected) <= 1e-12

        attn = inputs.attention_weights
        hessian = torch.func.jacrev(torch.func.jacrev(lambda a: loss(msda_of(inputs))(*primals[:2], a)))(attn)
    expected = torch.autograd.functional.hessian(lambda a: loss(oracle_of(inputs))(*primals[:2], a), attn)
    assert relative_error(hessian, expected) <= 1e-12


def test_samples_on_a_levels_top_and_left_edges(monkeypatch):
    """x_im = -1 or y_im = -1 exactly (x = -0.5 / W): cell -1, whose inside corners have weight 0
    but a location derivative. The pure-PyTorch placement (`torch_impl.corners`) once left such
    samples out, so the jvp, the double backward's location terms and the generic backward gave
    0 where the kernels, the CPU path and the oracle do not."""
    H, W = 3, 4
    gen = torch.Generator().manual_seed(31)
    value = torch.randn(1, H * W, 1, 3, generator=gen, dtype=torch.float64)
    loc = torch.tensor([[-0.5 / W, 0.4], [0.3, -0.5 / H], [-0.5 / W, -0.5 / H]], dtype=torch.float64)
    inputs = Inputs(value, torch.tensor([[H, W]]), torch.tensor([0]), loc.view(1, 3, 1, 1, 1, 2),
                    torch.ones(1, 3, 1, 1, 1, dtype=torch.float64))  # fmt: skip
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    direction = tangents(inputs, seed=32)
    _, expected = torch.autograd.functional.jvp(oracle_of(inputs), primals, direction)
    with backend("torch"):
        _, jvp = torch.func.jvp(msda_of(inputs), primals, direction)
    assert expected.abs().max() > 0 and relative_error(jvp, expected) <= 1e-12
    # The generic pure-PyTorch backward (CUDA float64 in deterministic mode, MPS, traced bodies).
    grad_output = torch.randn(1, 3, 3, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(torch_impl, "_is_eager_cpu", lambda *tensors: False)
    grads = torch_impl.backward(grad_output, *inputs.args())
    want = reference_with_grads(inputs, grad_output)[1:]
    assert want[1].abs().max() > 0
    for actual, expected_grad in zip(grads, want):
        assert relative_error(actual, expected_grad) <= 1e-12


# ---------------------------------------------------------------------------------------------
# The bare operator under forward-mode AD


def _raw_forward(inputs: Inputs):
    return lambda value, loc, attn: torch.ops.msda.forward(
        value, inputs.spatial_shapes, inputs.level_start_index, loc, attn
    )


FORWARD_MODE_CALLS = {
    "torch.func.jvp": lambda f, primals, direction: torch.func.jvp(f, primals, direction),
    "torch.func.jacfwd": lambda f, primals, direction: torch.func.jacfwd(f, argnums=1)(*primals),
    "forward_ad": lambda f, primals, direction: _dual_call(f, primals, direction),
}


def _dual_call(f, primals, direction):
    """(output, tangent) of f through torch.autograd.forward_ad, unpacked inside the dual level
    (after it closes, a dual's tangent is gone)."""
    with forward_ad.dual_level():
        unpacked = forward_ad.unpack_dual(f(*(forward_ad.make_dual(p, d) for p, d in zip(primals, direction))))
        return unpacked.primal, unpacked.tangent


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("how", FORWARD_MODE_CALLS)
def test_operator_under_forward_mode_ad_raises_naming_msda(how, path):
    inputs = smooth_inputs(SMALL, seed=31)
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    with backend(path), pytest.raises(RuntimeError, match=NO_FORWARD_AD.format(op="forward")):
        FORWARD_MODE_CALLS[how](_raw_forward(inputs), primals, tangents(inputs))


@pytest.mark.parametrize("how", ["torch.func.jvp", "forward_ad"])
def test_functional_form_never_returns_zero_tangents(how):
    """Whatever the functional form is built on: the right tangent or msda's error."""
    inputs = smooth_inputs(SMALL, seed=32)
    primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    direction = tangents(inputs, seed=33)
    _, expected = torch.autograd.functional.jvp(oracle_of(inputs), primals, direction)
    try:
        result = FORWARD_MODE_CALLS[how](msda_of(inputs), primals, direction)
    except RuntimeError as error:
        assert "msda" in str(error) and "forward-mode AD" in str(error)
        return
    tangent = result[1]
    assert tangent is not None and relative_error(tangent, expected) <= 1e-12


def test_operator_works_again_after_forward_mode_ad():
    inputs = smooth_inputs(SMALL, seed=34)
    with pytest.raises(RuntimeError):
        primals = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
        _dual_call(_raw_forward(inputs), primals, tangents(inputs))
    expected = reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights)
    assert relative_error(torch.ops.msda.forward(*inputs.args()), expected) <= 1e-12
