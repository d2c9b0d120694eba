"""Reference and inputs for checking MSDA implementations (used by msda's tests and bench).

`reference` is a float64 oracle written from the definition, independently of the operator's
code paths: a loop over levels, the four corners of each sample gathered by advanced indexing
from the level's (B, H, W, M, D) image, gradients by autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Deformable DETR at an 800x1333 image: levels of strides 8/16/32/64 (ceil), S = 22,223.
DETR_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))


@dataclass(frozen=True)
class Shape:
    batch: int
    queries: int  # None-like 0 is allowed (an empty call)
    heads: int
    head_dim: int
    levels: tuple[tuple[int, int], ...]
    points: int

    @property
    def num_values(self) -> int:
        return sum(h * w for h, w in self.levels)


# The operating points of docs/benchmarking.md (hidden size 256 = 8 heads x 32, 4 levels, 4 points).
PRESETS = {
    "decoder": Shape(batch=4, queries=300, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    "encoder": Shape(batch=2, queries=22223, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
}

# docs/contract.md: relative error against the float64 reference, per dtype.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tolerance(*dtypes: torch.dtype) -> float:
    """The bound for a result that went through all of `dtypes` (the least precise wins)."""
    return max(TOLERANCE[d] for d in dtypes)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN or inf anywhere gives inf.

    Where the reference is all zeros (every sample outside), the absolute norm is returned.
    """
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        return math.inf
    diff = torch.linalg.vector_norm(actual - expected).item()
    scale = torch.linalg.vector_norm(expected).item()
    return diff / scale if scale > 0 else diff


@dataclass
class Inputs:
    value: Tensor
    spatial_shapes: Tensor
    level_start_index: Tensor
    sampling_locations: Tensor
    attention_weights: Tensor

    def args(self) -> tuple[Tensor, ...]:
        return (
            self.value, self.spatial_shapes, self.level_start_index, self.sampling_locations, self.attention_weights
        )


def make_inputs(
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    loc_dtype: torch.dtype | None = None,
    dist: str = "uniform",
    outside_fraction: float = 0.0,
    seed: int = 0,
    requires_grad: bool = False,
    logits: bool = False,
) -> Inputs:
    """Random inputs (never zeros): value ~ N(0, 1), attention weights softmax-normalized over
    L*K (with `logits`, the attention_weights field holds the logits instead, N(0, 1): the input
    of the softmax operators, whose softmax is what the field holds otherwise), locations by `dist`:

    - "uniform": uniform in [0, 1];
    - "local": each query's reference point is its own pixel centre when Q equals S (an encoder),
      else a uniform random point, plus normal offsets of sigma = 2 pixels of each level.

    `outside_fraction` of the locations are then moved outside [0, 1] (to [-1, 0) or (1, 2]).
    """
    B, Q, M, D, K = shape.batch, shape.queries, shape.heads, shape.head_dim, shape.points
    L, S = len(shape.levels), shape.num_values
    loc_dtype = loc_dtype or dtype
    gen = torch.Generator().manual_seed(seed)

    value = torch.randn(B, S, M, D, generator=gen)
    spatial_shapes = torch.tensor(shape.levels, dtype=torch.int64)
    sizes = spatial_shapes.prod(1)
    level_start_index = sizes.cumsum(0) - sizes
    attention_logits = torch.randn(B, Q, M, L * K, generator=gen)
    attention_weights = (attention_logits if logits else attention_logits.softmax(-1)).view(B, Q, M, L, K)

    if dist == "uniform":
        loc = torch.rand(B, Q, M, L, K, 2, generator=gen)
    elif dist == "local":
        loc = _reference_points(shape, gen).view(B, Q, 1, 1, 1, 2)
        wh = spatial_shapes.flip(1).to(torch.float32).view(1, 1, 1, L, 1, 2)  # (W_l, H_l)
        loc = loc + 2.0 * torch.randn(B, Q, M, L, K, 2, generator=gen) / wh
    else:
        raise ValueError(f"dist must be 'uniform' or 'local', got {dist!r}")

    if outside_fraction > 0:
        moved = torch.rand(loc.shape, generator=gen) < outside_fraction
        away = torch.rand(loc.shape, generator=gen)
        outside = torch.where(torch.rand(loc.shape, generator=gen) < 0.5, -away, 1 + away)
        loc = torch.where(moved, outside, loc)

    def place(t: Tensor, dt: torch.dtype) -> Tensor:
        return t.to(device=device, dtype=dt).requires_grad_(requires_grad)

    return Inputs(
        value=place(value, dtype),
        spatial_shapes=spatial_shapes.to(device),
        level_start_index=level_start_index.to(device),
        sampling_locations=place(loc, loc_dtype),
        attention_weights=place(attention_weights, loc_dtype),
    )


def _reference_points(shape: Shape, gen: torch.Generator) -> Tensor:
    """(B, Q, 2) normalized reference points: pixel centres of the pyramid for an encoder."""
    B, Q = shape.batch, shape.queries
    if Q != shape.num_values:
        return torch.rand(B, Q, 2, generator=gen)
    centres = []
    for h, w in shape.levels:
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        centres.append(torch.stack(((xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h), dim=-1))
    return torch.cat(centres).expand(B, Q, 2)


def reference(
    value: Tensor,
    spatial_shapes: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    """float64 MSDA from the definition (on the inputs' device), differentiable by autograd.

    Levels are read from spatial_shapes alone (start rows are the running sum of H_l * W_l).
    """
    value = value.to(torch.float64)
    loc = sampling_locations.to(torch.float64)
    attn = attention_weights.to(torch.float64)
    B, S, M, D = value.shape
    Q = loc.shape[1]
    batch = torch.arange(B, device=value.device).view(B, 1, 1, 1)
    head = torch.arange(M, device=value.device).view(1, 1, M, 1)

    out = value.new_zeros(B, Q, M, D)
    start = 0
    for level, (h, w) in enumerate(spatial_shapes.tolist()):
        image = value[:, start : start + h * w].reshape(B, h, w, M, D)
        start += h * w
        px = loc[:, :, :, level, :, 0] * w - 0.5  # (B, Q, M, K) in pixels, centres at +0.5
        py = loc[:, :, :, level, :, 1] * h - 0.5
        finite = torch.isfinite(px) & torch.isfinite(py)
        # Move non-finite samples far outside before any arithmetic, so autograd sees no NaN.
        px = torch.where(finite, px, -10.0)
        py = torch.where(finite, py, -10.0)
        left, top = px.detach().floor(), py.detach().floor()
        for cx, wx in ((left, 1 - (px - left)), (left + 1, px - left)):
            for cy, wy in ((top, 1 - (py - top)), (top + 1, py - top)):
                inside = (cx >= 0) & (cx <= w - 1) & (cy >= 0) & (cy <= h - 1)
                xi = torch.where(inside, cx, 0).long()
                yi = torch.where(inside, cy, 0).long()
                # An outside corner's value 0 before the product (not the product masked after it):
                # else its weight's gradient would be 0 * value, NaN next to an inf in value.
                corner_value = torch.where(inside.unsqueeze(-1), image[batch, yi, xi, head], 0.0)  # (B, Q, M, K, D)
                contribution = (attn[:, :, :, level] * wx * wy).unsqueeze(-1) * corner_value
                out = out + contribution.sum(3)
    return out.reshape(B, Q, M * D)


def reference_softmax(
    value: Tensor,
    spatial_shapes: Tensor,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> Tensor:
    """`reference` on the float64 softmax of the logits over the L * K samples of each (batch,
    query, head): the definition of the softmax operators, differentiable by autograd."""
    logits = attention_logits.to(torch.float64)
    weights = logits.flatten(-2).softmax(-1).view(logits.shape)
    return reference(value, spatial_shapes, sampling_locations, weights)


def reference_with_grads(
    inputs: Inputs, grad_output: Tensor, softmax: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, grad_value, grad_sampling_locations, grad_attention_weights), all float64. With
    `softmax`, inputs.attention_weights holds logits (`reference_softmax`), and the last
    gradient is theirs."""
    value = inputs.value.detach().to(torch.float64).requires_grad_()
    loc = inputs.sampling_locations.detach().to(torch.float64).requires_grad_()
    attn = inputs.attention_weights.detach().to(torch.float64).requires_grad_()
    out = (reference_softmax if softmax else reference)(value, inputs.spatial_shapes, loc, attn)
    out.backward(grad_output.detach().to(torch.float64))
    return out.detach(), value.grad, loc.grad, attn.grad
