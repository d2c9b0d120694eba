"""Pure-PyTorch MSDA: the path for CPU and every device without the Triton kernels.

Written with gathers (index_select) and scatters (index_add_) over `value` viewed as rows of
D channels, so that it allocates no (B, Q, M, L, K, D)-sized index tensor, has no data-dependent
Python control flow (torch.compile traces it with dynamic shapes), and gives the backward
explicitly: autograd does not run inside an operator's body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64 (gradcheck), else float32 accumulation."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class Corner(NamedTuple):
    row: Tensor  # (B, Q, M, L, K) int64 row of value.view(B * S * M, D); 0 where masked
    inside: Tensor  # (B, Q, M, L, K) bool: the corner lies inside its level
    weight: Tensor  # bilinear weight, 0 where masked
    dweight_dx: Tensor  # d weight / d x_im, 0 where masked
    dweight_dy: Tensor  # d weight / d y_im, 0 where masked


def _corners(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor, ctype: torch.dtype
) -> Iterator[Corner]:
    B, S, M, _ = value.shape
    L = spatial_shapes.shape[0]
    device = value.device
    shapes = spatial_shapes.to(torch.int64)
    h = shapes[:, 0].view(1, 1, 1, L, 1)
    w = shapes[:, 1].view(1, 1, 1, L, 1)
    start = level_start_index.to(torch.int64).view(1, 1, 1, L, 1)

    # grid_sample's align_corners=False convention: pixel centres at integer + 0.5. Positions in
    # float64 (exact for float32 locations: see msda/kernels/sampling.py), where the device has it.
    pos = torch.float32 if device.type == "mps" else torch.float64
    x = sampling_locations[..., 0].to(pos) * w.to(pos) - 0.5
    y = sampling_locations[..., 1].to(pos) * h.to(pos) - 0.5
    # NaN compares false, so non-finite locations land outside and touch nothing.
    touches_level = (x > -1) & (x < w) & (y > -1) & (y < h)
    x = torch.where(touches_level, x, 0.0)
    y = torch.where(touches_level, y, 0.0)
    x0f, y0f = x.floor(), y.floor()
    fx, fy = (x - x0f).to(ctype), (y - y0f).to(ctype)
    x0, y0 = x0f.to(torch.int64), y0f.to(torch.int64)

    batch = torch.arange(B, device=device).view(-1, 1, 1, 1, 1)
    head = torch.arange(M, device=device).view(1, 1, -1, 1, 1)
    for dy in (0, 1):
        for dx in (0, 1):
            xi, yi = x0 + dx, y0 + dy
            pixel = start + yi * w + xi
            inside = touches_level & (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h) & (pixel >= 0) & (pixel < S)
            row = (batch * S + torch.where(inside, pixel, 0)) * M + head
            wx = fx if dx else 1 - fx
            wy = fy if dy else 1 - fy
            sign_x = 1.0 if dx else -1.0
            sign_y = 1.0 if dy else -1.0
            zero = torch.zeros((), dtype=ctype, device=device)
            yield Corner(
                row=row,
                inside=inside,
                weight=torch.where(inside, wx * wy, zero),
                dweight_dx=torch.where(inside, sign_x * wy, zero),
                dweight_dy=torch.where(inside, sign_y * wx, zero),
            )


def _gather(rows_of_value: Tensor, corner: Corner, ctype: torch.dtype) -> Tensor:
    """(B, Q, M, L, K, D) corner values, exactly 0 where the corner is outside (even if value is inf)."""
    picked = rows_of_value.index_select(0, corner.row.reshape(-1)).view(*corner.row.shape, rows_of_value.shape[1])
    picked = picked.to(ctype)
    return torch.where(corner.inside.unsqueeze(-1), picked, 0.0)


def forward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    B, _, M, D = value.shape
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    rows_of_value = value.reshape(-1, D)
    attn = attention_weights.to(ctype)
    out = torch.zeros((B, Q, M, D), dtype=ctype, device=value.device)
    for corner in _corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        weighted = (attn * corner.weight).unsqueeze(-1) * _gather(rows_of_value, corner, ctype)
        out = out + weighted.sum(dim=(3, 4))
    return out.view(B, Q, M * D).to(value.dtype)


def backward(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    B, _, M, D = value.shape
    L = spatial_shapes.shape[0]
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    rows_of_value = value.reshape(-1, D)
    attn = attention_weights.to(ctype)
    grad_out = grad_output.reshape(B, Q, M, 1, 1, D).to(ctype)

    grad_rows = torch.zeros(rows_of_value.shape, dtype=ctype, device=value.device)
    grad_attn = torch.zeros(attn.shape, dtype=ctype, device=value.device)
    grad_x = torch.zeros_like(grad_attn)
    grad_y = torch.zeros_like(grad_attn)
    for corner in _corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        # <grad_out, corner value>: everything but grad_value needs only this dot product.
        dot = (_gather(rows_of_value, corner, ctype) * grad_out).sum(-1)
        grad_attn = grad_attn + corner.weight * dot
        grad_x = grad_x + corner.dweight_dx * dot
        grad_y = grad_y + corner.dweight_dy * dot
        contribution = (attn * corner.weight).unsqueeze(-1) * grad_out
        grad_rows = grad_rows.index_add(0, corner.row.reshape(-1), contribution.reshape(-1, D))

    shapes = spatial_shapes.to(ctype)
    # Chain rule through x_im = x * W_l - 0.5 (and y likewise).
    grad_x = grad_x * attn * shapes[:, 1].view(1, 1, 1, L, 1)
    grad_y = grad_y * attn * shapes[:, 0].view(1, 1, 1, L, 1)
    grad_loc = torch.stack((grad_x, grad_y), dim=-1)
    return (
        grad_rows.view(value.shape).to(value.dtype),
        grad_loc.to(sampling_locations.dtype),
        grad_attn.to(attention_weights.dtype),
    )


# --- The softmax operators: attention logits, normalized over the L * K samples of each head ---


def softmax_weights(attention_logits: Tensor, *others: Tensor) -> Tensor:
    """softmax over the L * K logits of each (batch, query, head), in the compute dtype of the
    call (float32, float64 for float64 inputs), shaped (B, Q, M, L, K). torch.softmax's
    semantics: a -inf logit gets weight 0, a row of -inf only or with a +inf or NaN is NaN."""
    ctype = compute_dtype(attention_logits, *others)
    B, Q, M, L, K = attention_logits.shape
    flat = attention_logits.to(ctype).reshape(B, Q, M, L * K)
    return torch.softmax(flat, dim=-1).view(B, Q, M, L, K)


def forward_softmax(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> Tensor:
    weights = softmax_weights(attention_logits, value, sampling_locations)
    return forward(value, spatial_shapes, level_start_index, sampling_locations, weights)


def backward_softmax(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward above with the softmax's weights, then the softmax backward, explicit:
    d logit_j = p_j * (g_j - sum_i p_i g_i), g the gradient of the normalized weights."""
    weights = softmax_weights(attention_logits, value, sampling_locations)  # in the compute dtype
    grad_value, grad_loc, grad_weights = backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, weights
    )
    B, Q, M, L, K = attention_logits.shape
    p = weights.view(B, Q, M, L * K)
    g = grad_weights.view(B, Q, M, L * K)
    grad_logits = p * (g - (p * g).sum(dim=-1, keepdim=True))
    return grad_value, grad_loc, grad_logits.view(B, Q, M, L, K).to(attention_logits.dtype)
