"""The operator's higher derivatives: forward mode (a jvp) and the derivative of the backward
(double backward: gradient penalties, Hessian-vector products).

Per sample s = (b, q, m, l, k) with weight A and location (x, y) on a level of W x H pixels,
x_im = x * W - 0.5, y_im = y * H - 0.5, and the four corners c of its cell, each with value row
v_c (zero outside the level), bilinear weight w_c = wx_c * wy_c and signs sx_c, sy_c (+1 for the
right / lower corner, -1 for the left / upper one):

    out[b, q, m]  = sum_{l,k,c} A * w_c * v_c
    d w_c / d x_im = sx_c * wy_c,  d w_c / d y_im = sy_c * wx_c,  d2 w_c / (d x_im d y_im) = sx_c * sy_c

and d2 w_c / d x_im2 = d2 w_c / d y_im2 = 0 inside a cell. The output is linear in `value` and
in the weights, so those parts of every derivative are calls of msda's own forward and backward
operators with a tangent (or cotangent) in place of `value` or the weights; what remains, the
location terms, is gathered here in pure PyTorch (any device, compilable, no host sync).

Sampling follows the operator exactly (positions in float64, a corner outside its level or past
`value` contributes nothing, a non-finite location touches nothing), as do the non-finite weight
semantics: a non-finite weight makes its (batch, query, head) NaN.

The derivatives are those of the bilinear interpolation inside each cell. On a cell border the
location derivative jumps (the operator's backward takes the one-sided derivative of the cell
floor() picks); the second derivative there is that of the same cell.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .torch_impl import compute_dtype, corners, finite_weights, gather
from .validation import reject_forward_ad


def _level_sizes(spatial_shapes: Tensor, ctype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(W, H) of each sample's level as (1, 1, 1, L, 1) `ctype` tensors."""
    shapes = spatial_shapes.to(ctype).view(1, 1, 1, -1, 2)
    return shapes[..., 1:], shapes[..., :1]


def location_jvp(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    sampling_locations_tangent: Tensor,
) -> Tensor:
    """(B, Q, M * D) derivative of the output along a tangent of the locations alone, in the
    compute dtype (float32, or float64 for float64 inputs):
    sum_{l,k,c} A * (dx * W * sx_c * wy_c + dy * H * sy_c * wx_c) * v_c."""
    B, _, M, D = value.shape
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights, sampling_locations_tangent)
    W, H = _level_sizes(spatial_shapes, ctype)
    attn = finite_weights(attention_weights, ctype)
    tx = sampling_locations_tangent[..., 0].to(ctype) * W  # tangent of x_im
    ty = sampling_locations_tangent[..., 1].to(ctype) * H
    rows_of_value = value.reshape(-1, D)
    out = torch.zeros((B, Q, M, D), dtype=ctype, device=value.device)
    for c in corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        coefficient = attn * (tx * c.sign_x * c.wy + ty * c.sign_y * c.wx)
        out = out + (coefficient.unsqueeze(-1) * gather(rows_of_value, c, ctype)).sum(dim=(3, 4))
    return out.view(B, Q, M * D)


def forward_jvp(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    value_tangent: Tensor | None,
    sampling_locations_tangent: Tensor | None,
    attention_weights_tangent: Tensor | None,
) -> Tensor:
    """The forward-mode derivative (jvp) of msda's output, (B, Q, M * D) in value's dtype.

    Tangents have their input's shape; None is a zero tangent. The output is linear in `value`
    and in the weights, so those two terms are the operator itself with the tangent in place of
    the input; the location term is `location_jvp`. Call it where forward gradients are off (an
    autograd.Function's jvp), as it calls the operator.
    """
    B, _, M, D = value.shape
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    total = torch.zeros((B, Q, M * D), dtype=ctype, device=value.device)
    args = (spatial_shapes, level_start_index, sampling_locations)
    if value_tangent is not None:
        total = total + torch.ops.msda.forward(value_tangent.to(value.dtype), *args, attention_weights).to(ctype)
    if attention_weights_tangent is not None:
        tangent = attention_weights_tangent.to(attention_weights.dtype)
        total = total + torch.ops.msda.forward(value, *args, tangent).to(ctype)
    if sampling_locations_tangent is not None:
        total = total + location_jvp(value, *args, attention_weights, sampling_locations_tangent)
    return total.to(value.dtype)


def _location_cotangent_terms(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    grad_loc_cotangent: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The parts of the backward's derivative that come from a cotangent on its location
    gradient, (c_x, c_y) per sample, and are not calls of the operator:

        T = sum_s A * sum_c (c_x W sx_c wy_c + c_y H sy_c wx_c) <g, v_c>

    Returns (dT/d value, dT/d sampling_locations through the cell's twist sx_c sy_c,
    dT/d attention_weights), in the compute dtype. (dT/d grad_output is `location_jvp`.)"""
    B, S, M, D = value.shape
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(grad_output, value, sampling_locations, attention_weights, grad_loc_cotangent)
    W, H = _level_sizes(spatial_shapes, ctype)
    attn = finite_weights(attention_weights, ctype)
    g = grad_output.reshape(B, Q, M, 1, 1, D).to(ctype)
    tx = grad_loc_cotangent[..., 0].to(ctype) * W
    ty = grad_loc_cotangent[..., 1].to(ctype) * H

    grad_rows = torch.zeros((B * S * M, D), dtype=ctype, device=value.device)
    grad_attn = torch.zeros(attn.shape, dtype=ctype, device=value.device)
    twist = torch.zeros_like(grad_attn)  # sum_c sx_c sy_c <g, v_c>
    rows_of_value = value.reshape(-1, D)
    for c in corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        dot = (gather(rows_of_value, c, ctype) * g).sum(-1)  # <g, v_c>, zero outside
        coefficient = tx * c.sign_x * c.wy + ty * c.sign_y * c.wx
        grad_attn = grad_attn + coefficient * dot
        twist = twist + (c.sign_x * c.sign_y) * dot
        scatter = torch.where(c.inside, attn * coefficient, 0.0).unsqueeze(-1) * g
        grad_rows = grad_rows.index_add(0, c.row.reshape(-1), scatter.reshape(-1, D))
    grad_loc = torch.stack((W * attn * ty * twist, H * attn * tx * twist), dim=-1)
    return grad_rows.view(B, S, M, D), grad_loc, grad_attn


def backward_setup_context(ctx, inputs, output) -> None:
    """register_autograd's setup_context for msda::backward: keep every input."""
    ctx.save_for_backward(*inputs)


def backward_backward(ctx, grad_value_cotangent, grad_loc_cotangent, grad_attn_cotangent):
    """The derivative of msda::backward (register_autograd's backward for it): given cotangents
    on its three outputs, the gradients for (grad_output, value, -, -, sampling_locations,
    attention_weights). With (cV, cL, cA) the cotangents, g the grad_output and J the
    Jacobian of the forward:

    - grad_output: J (cV, cL, cA), the forward's jvp (the backward is J^T g);
    - value: the backward's grad_value with the weights cA, plus the scatter of the location term;
    - attention_weights: the backward's grad_attn with cV in place of value, plus the location term;
    - sampling_locations: the backward's location gradient with cA as the weights and with cV as
      the value, plus the cross term d2 w / (dx dy) of the location cotangent.
    """
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    needs_g, needs_value, _, _, needs_loc, needs_attn = ctx.needs_input_grad
    args = (spatial_shapes, level_start_index, sampling_locations)
    ctype = compute_dtype(grad_output, value, sampling_locations, attention_weights)
    cV, cL, cA = grad_value_cotangent, grad_loc_cotangent, grad_attn_cotangent

    # Each gradient is a sum of terms, one per nonzero cotangent that reaches it.
    terms: dict[str, list[Tensor]] = {"value": [], "loc": [], "attn": []}
    if (needs_value or needs_loc) and cA is not None:  # the backward with cA as the weights
        by_cA = torch.ops.msda.backward(grad_output, value, *args, cA.to(attention_weights.dtype))
        terms["value"].append(by_cA[0])
        terms["loc"].append(by_cA[1])
    if (needs_loc or needs_attn) and cV is not None:  # the backward with cV as the value
        by_cV = torch.ops.msda.backward(grad_output, cV.to(value.dtype), *args, attention_weights)
        terms["loc"].append(by_cV[1])
        terms["attn"].append(by_cV[2])
    if (needs_value or needs_loc or needs_attn) and cL is not None:
        by_cL = _location_cotangent_terms(grad_output, value, *args, attention_weights, cL)
        for name, term in zip(("value", "loc", "attn"), by_cL):
            terms[name].append(term)

    def total(name: str, like: Tensor) -> Tensor:
        if not terms[name]:
            return torch.zeros_like(like)
        return sum(t.to(ctype) for t in terms[name]).to(like.dtype)

    grad_g = forward_jvp(value, *args, attention_weights, cV, cL, cA).to(grad_output.dtype) if needs_g else None
    grad_value = total("value", value) if needs_value else None
    grad_loc = total("loc", sampling_locations) if needs_loc else None
    grad_attn = total("attn", attention_weights) if needs_attn else None
    return grad_g, grad_value, None, None, grad_loc, grad_attn


def forward_mode_active() -> bool:
    """Whether a call is differentiated in forward mode or transformed by torch.func (jvp,
    jacfwd, vmap): then the functional form goes through OperatorWithJvp."""
    if torch.compiler.is_compiling():
        return False
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


class OperatorWithJvp(torch.autograd.Function):
    """msda's forward operator with forward-mode AD (forward_jvp): what the functional form calls
    under torch.autograd.forward_ad and torch.func transforms, where the registered operator has
    no jvp (torch.library's autograd has none). setup_context style, so torch.func accepts it;
    the backward is the operator's, so double backward works through it too."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*inputs)
        ctx.save_for_backward(*inputs)

    @staticmethod
    def jvp(ctx, value_t, _shapes_t, _starts_t, loc_t, attn_t):
        return forward_jvp(*ctx.saved_tensors, value_t, loc_t, attn_t)

    @staticmethod
    def backward(ctx, grad_output):
        # Forward over reverse (torch.func.hessian, jacfwd(jacrev(...))): the backward has no
        # forward-mode formula; the operator's own error, not torch.func's about the Function below.
        reject_forward_ad("backward")
        value, shapes, starts, loc, attn = ctx.saved_tensors
        grad_value, grad_loc, grad_attn = BackwardWithDerivative.apply(grad_output, value, shapes, starts, loc, attn)
        return grad_value, None, None, grad_loc, grad_attn


class BackwardWithDerivative(torch.autograd.Function):
    """msda::backward with its derivative (`backward_backward`), as OperatorWithJvp's backward
    calls it: under torch.func.grad the backward runs inside the transform, where the autograd
    that torch.library generates for the operator raises (it is not a setup_context Function)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        backward_setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_value_cotangent, grad_loc_cotangent, grad_attn_cotangent):
        return backward_backward(ctx, grad_value_cotangent, grad_loc_cotangent, grad_attn_cotangent)
