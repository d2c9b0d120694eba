"""The `MultiScaleDeformableAttention` extension module of Deformable DETR and DINO, on msda.

The two functions have the compiled extension's signatures. `im2col_step` is accepted and
ignored: msda needs no batch chunking, so a batch it does not divide is fine.
"""

from __future__ import annotations

import torch
from torch import Tensor

import msda  # noqa: F401  (registers torch.ops.msda.*)


def ms_deform_attn_forward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_loc: Tensor,
    attn_weight: Tensor,
    im2col_step: int = 64,
) -> Tensor:
    """(B, Q, M * D) output; the arguments are laid out as in `torch.ops.msda.forward`."""
    return torch.ops.msda.forward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight)


def ms_deform_attn_backward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_loc: Tensor,
    attn_weight: Tensor,
    grad_output: Tensor,
    im2col_step: int = 64,
) -> list[Tensor]:
    """[grad_value, grad_sampling_loc, grad_attn_weight], a list as the C++ extension returns."""
    return list(
        torch.ops.msda.backward(grad_output, value, spatial_shapes, level_start_index, sampling_loc, attn_weight)
    )
