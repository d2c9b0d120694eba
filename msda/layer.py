"""The Deformable DETR attention layer (`MSDeformAttn`) on the msda operator.

Constructor, parameter names and shapes, initialization and forward follow the original layer,
so an `MSDeformAttn` state_dict loads unchanged and gives the same output.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from .functional import multi_scale_deformable_attention, multi_scale_deformable_attention_softmax


class MultiScaleDeformableAttention(nn.Module):
    """Multi-scale deformable attention of Deformable DETR.

    Args:
        d_model: hidden size of queries and input features (divisible by n_heads).
        n_levels: number of feature levels.
        n_heads: number of attention heads.
        n_points: sampling points per head and level.
        fused_softmax: normalize the attention weights inside the operator
            (`multi_scale_deformable_attention_softmax`, the default) rather than by a separate
            softmax before it (`multi_scale_deformable_attention`, as the original layer does).
            The same result within the operator's tolerance; not part of the state_dict.
    """

    def __init__(
        self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4, fused_softmax: bool = True
    ):
        super().__init__()
        for name, size in (("d_model", d_model), ("n_levels", n_levels), ("n_heads", n_heads), ("n_points", n_points)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={d_model} and n_heads={n_heads}")
        head_dim = d_model // n_heads
        if head_dim & (head_dim - 1) != 0:
            # Kept from the original, whose CUDA kernel was fastest for such sizes; msda works with any.
            warnings.warn(
                f"d_model // n_heads = {head_dim} is not a power of 2; Deformable DETR recommends one",
                stacklevel=2,
            )

        self.d_model = d_model
        self.n_levels = n_levels
        self.n_heads = n_heads
        self.n_points = n_points
        self.fused_softmax = bool(fused_softmax)

        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    # The original's name: Deformable DETR's transformer calls it on every MSDeformAttn it holds.
    def _reset_parameters(self) -> None:
        """Offsets start on rays: head h points at angle 2*pi*h/n_heads, point i at distance i + 1.

        Each ray's (cos, sin) is scaled so its larger coordinate is 1 (a square, not a circle),
        the same for every level. Attention starts uniform; the projections are Xavier-uniform.
        """
        nn.init.zeros_(self.sampling_offsets.weight)
        angles = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        directions = torch.stack((angles.cos(), angles.sin()), dim=-1)
        directions = directions / directions.abs().max(dim=-1, keepdim=True).values
        distances = torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, self.n_points, 1)
        grid = directions.view(self.n_heads, 1, 1, 2) * distances  # (n_heads, 1, n_points, 2)
        grid = grid.expand(self.n_heads, self.n_levels, self.n_points, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))

        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for projection in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(projection.weight)
            nn.init.zeros_(projection.bias)

    def forward(
        self,
        query: Tensor,
        reference_points: Tensor,
        input_flatten: Tensor,
        input_spatial_shapes: Tensor,
        input_level_start_index: Tensor | None,
        input_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """
        Args:
            query: (N, Len_q, d_model).
            reference_points: (N, Len_q, n_levels, 2) normalized (x, y) points, or
                (N, Len_q, n_levels, 4) boxes (cx, cy, w, h); [0, 1] covers the image with padding.
            input_flatten: (N, Len_in, d_model), the levels flattened and concatenated.
            input_spatial_shapes: (n_levels, 2) integer (H_l, W_l).
            input_level_start_index: (n_levels,) start row of each level in Len_in, or None.
            input_padding_mask: (N, Len_in) bool, True at padding (those values read as zero).

        Returns:
            (N, Len_q, d_model).
        """
        N, Len_q, _ = query.shape
        _, Len_in, _ = input_flatten.shape
        H, L, K = self.n_heads, self.n_levels, self.n_points

        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, Len_in, H, self.d_model // H)

        offsets = self.sampling_offsets(query).view(N, Len_q, H, L, K, 2)
        logits = self.attention_weights(query)

        if reference_points.shape[-1] == 2:
            # Offsets are in pixels of each level: divide by (W_l, H_l).
            wh = torch.stack((input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]), dim=-1)
            locations = reference_points[:, :, None, :, None, :] + offsets / wh[None, None, None, :, None, :]
        elif reference_points.shape[-1] == 4:
            # Offsets are in units of half the box per point count: point i reaches (i + 1) / K half-boxes.
            centre = reference_points[:, :, None, :, None, :2]
            size = reference_points[:, :, None, :, None, 2:]
            locations = centre + offsets / K * size * 0.5
        else:
            raise ValueError(
                "reference_points must end in 2 (x, y) or 4 (cx, cy, w, h) coordinates, "
                f"got shape {tuple(reference_points.shape)}"
            )

        if self.fused_softmax:  # the softmax over each head's L * K samples inside the operator
            output = multi_scale_deformable_attention_softmax(
                value, input_spatial_shapes, input_level_start_index, locations, logits.view(N, Len_q, H, L, K)
            )
        else:
            weights = logits.view(N, Len_q, H, L * K).softmax(-1).view(N, Len_q, H, L, K)
            output = multi_scale_deformable_attention(
                value, input_spatial_shapes, input_level_start_index, locations, weights
            )
        return self.output_proj(output)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, "
            f"n_points={self.n_points}, fused_softmax={self.fused_softmax}"
        )
