"""The `MultiScaleDeformableAttention` extension module of Deformable DETR and DINO, on msda.

The two functions have the compiled extension's signatures. `im2col_step` is accepted and
ignored: msda needs no batch chunking, so a batch it does not divide is fine. In eager mode they
take msda's fast paths (msda/eager.py, msda/eager_cpu.py), which skip the registered operator's
dispatch cost; anything traced goes through torch.ops.msda.*.
"""

from __future__ import annotations

from torch import Tensor

from msda import eager


def ms_deform_attn_forward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_loc: Tensor,
    attn_weight: Tensor,
    im2col_step: int = 64,
) -> Tensor:
    """(B, Q, M * D) output; the arguments are laid out as in `torch.ops.msda.forward`."""
    return eager.forward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight)


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
    return list(eager.backward(grad_output, value, spatial_shapes, level_start_index, sampling_loc, attn_weight))
