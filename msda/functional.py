"""The functional form of the operator."""

from __future__ import annotations

import torch
from torch import Tensor

from . import derivatives, eager, eager_cpu, validation
from .validation import check_tensor


def level_start_index_from_shapes(spatial_shapes: Tensor) -> Tensor:
    """(L,) int64 start row of each level in the flattened value, computed on the shapes' device."""
    check_tensor("spatial_shapes", spatial_shapes)
    sizes = spatial_shapes.to(torch.int64).prod(dim=1)
    return sizes.cumsum(0) - sizes


def multi_scale_deformable_attention(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    """Multi-scale deformable attention, as Deformable DETR's compiled op computes it.

    Args:
        value: (B, S, M, D), the L levels flattened row-major and concatenated along S.
        spatial_shapes: (L, 2) int64 or int32 (H_l, W_l) per level.
        level_start_index: (L,) int64 or int32 start row of each level in S, or None to compute it.
        sampling_locations: (B, Q, M, L, K, 2) normalized (x, y), nominally in [0, 1];
            bilinear sampling with zero padding, as F.grid_sample(align_corners=False).
        attention_weights: (B, Q, M, L, K), used as given (no softmax).

    Returns:
        (B, Q, M * D) in value's dtype. Differentiable in value, sampling_locations and
        attention_weights.

    Raises:
        TypeError, ValueError: naming the argument, for any call outside this contract.
    """
    return _call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, softmax=False)


def multi_scale_deformable_attention_softmax(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    sampling_locations: Tensor,
    attention_logits: Tensor,
) -> Tensor:
    """Multi-scale deformable attention on attention logits: the weights are their softmax over
    the L * K samples of each (batch, query, head), computed inside the kernels. The same as

        weights = attention_logits.flatten(-2).softmax(-1).view(attention_logits.shape)
        multi_scale_deformable_attention(value, spatial_shapes, level_start_index, sampling_locations, weights)

    without the two passes over a (B, Q, M, L * K) tensor that the separate softmax costs, forward
    and backward.

    Args:
        value, spatial_shapes, level_start_index, sampling_locations: as for
            `multi_scale_deformable_attention`.
        attention_logits: (B, Q, M, L, K) logits, any float dtype. The softmax computes in float32
            (float64 for float64 inputs) with torch.softmax's semantics: a -inf logit gets weight 0;
            a head whose logits are all -inf, or include +inf or NaN, gets NaN weights (then a NaN
            output).

    Returns:
        (B, Q, M * D) in value's dtype. Differentiable in value, sampling_locations and
        attention_logits.

    Raises:
        TypeError, ValueError: naming the argument, for any call outside this contract.
    """
    return _call(value, spatial_shapes, level_start_index, sampling_locations, attention_logits, softmax=True)


def _call(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax: bool) -> Tensor:
    if eager.eligible(value, spatial_shapes, level_start_index, sampling_locations, attention):
        # Eager CUDA call: the same kernels without the operator's dispatch cost (msda/eager.py).
        return eager.differentiable_forward(
            value, spatial_shapes, level_start_index, sampling_locations, attention, softmax
        )
    if level_start_index is None:
        level_start_index = level_start_index_from_shapes(spatial_shapes)
    if eager_cpu.eligible(value, spatial_shapes, level_start_index, sampling_locations, attention):
        # Eager CPU call: the CPU path without the operator's dispatch cost (msda/eager_cpu.py).
        return eager_cpu.forward(value, spatial_shapes, level_start_index, sampling_locations, attention, softmax)
    validation.check_operator_args(
        validation.weights_name(softmax),
        value=value,
        spatial_shapes=spatial_shapes,
        level_start_index=level_start_index,
        sampling_locations=sampling_locations,
        attention=attention,
    )
    # Under torch.compile with msda.validate() on: the data checks as an operator of the graph
    # (docs/correctness.md says why here and not in the operator's body).
    level_start_index = validation.check_level_data_when_validating(value, spatial_shapes, level_start_index)
    if derivatives.forward_mode_active():
        # Forward-mode AD and torch.func: the operator's jvp (the registered operators have none),
        # on weights normalized here for the softmax form.
        if softmax:
            logits = attention if attention.dtype == torch.float64 else attention.float()
            attention = logits.flatten(-2).softmax(-1).view(attention.shape)
        return derivatives.OperatorWithJvp.apply(
            value, spatial_shapes, level_start_index, sampling_locations, attention
        )
    op = torch.ops.msda.forward_softmax if softmax else torch.ops.msda.forward
    return op(value, spatial_shapes, level_start_index, sampling_locations, attention)
