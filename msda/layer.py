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
            if not isinstance(size, int) or isinstance(size, bool):  # True is an int to Python
                raise TypeError(f"{name} must be a positive int, got {size!r} ({type(size).__name__})")
            if size < 1:
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
        self._check_args(
            query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index, input_padding_mask
        )
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
        else:  # 4 coordinates, as _check_args made sure
            # Offsets are in units of half the box per point count: point i reaches (i + 1) / K half-boxes.
            centre = reference_points[:, :, None, :, None, :2]
            size = reference_points[:, :, None, :, None, 2:]
            locations = centre + offsets / K * size * 0.5

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

    def _check_args(
        self,
        query: Tensor,
        reference_points: Tensor,
        input_flatten: Tensor,
        input_spatial_shapes: Tensor,
        input_level_start_index: Tensor | None,
        input_padding_mask: Tensor | None,
    ) -> None:
        """TypeError/ValueError naming the argument and the expected shape, as the operator's
        checks do (metadata only: no host sync; the operator checks the level data)."""
        d_model, L = self.d_model, self.n_levels
        _tensor("query", query, 3, "(N, Len_q, d_model)", _FLOATS)
        _tensor("reference_points", reference_points, 4, "(N, Len_q, n_levels, 2 or 4)", _FLOATS)
        _tensor("input_flatten", input_flatten, 3, "(N, Len_in, d_model)", _FLOATS)
        _tensor("input_spatial_shapes", input_spatial_shapes, 2, "(n_levels, 2)", _INTEGERS)
        N, Len_q, Len_in = query.shape[0], query.shape[1], input_flatten.shape[1]
        _size("query", query, 2, d_model, "channels", "d_model")
        _size("input_flatten", input_flatten, 0, N, "batch entries", "query")
        _size("input_flatten", input_flatten, 2, d_model, "channels", "d_model")
        _size("reference_points", reference_points, 0, N, "batch entries", "query")
        _size("reference_points", reference_points, 1, Len_q, "queries", "query")
        _size("reference_points", reference_points, 2, L, "levels", "n_levels")
        if reference_points.shape[3] not in (2, 4):
            raise ValueError(
                "reference_points must end in 2 (x, y) or 4 (cx, cy, w, h) coordinates, "
                f"got shape {tuple(reference_points.shape)}"
            )
        _size("input_spatial_shapes", input_spatial_shapes, 0, L, "levels", "n_levels")
        _size("input_spatial_shapes", input_spatial_shapes, 1, 2, "sizes per level", "(H, W)")
        tensors = {
            "reference_points": reference_points,
            "input_flatten": input_flatten,
            "input_spatial_shapes": input_spatial_shapes,
        }
        if input_level_start_index is not None:
            _tensor("input_level_start_index", input_level_start_index, 1, "(n_levels,)", _INTEGERS)
            _size("input_level_start_index", input_level_start_index, 0, L, "levels", "n_levels")
            tensors["input_level_start_index"] = input_level_start_index
        if input_padding_mask is not None:
            _tensor("input_padding_mask", input_padding_mask, 2, "(N, Len_in)", (torch.bool,))
            _size("input_padding_mask", input_padding_mask, 0, N, "batch entries", "query")
            _size("input_padding_mask", input_padding_mask, 1, Len_in, "tokens", "input_flatten")
            tensors["input_padding_mask"] = input_padding_mask
        for name, t in tensors.items():
            if t.device != query.device:
                raise ValueError(
                    f"{name} is on {t.device} but query is on {query.device}: all tensors must be on one device"
                )

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, "
            f"n_points={self.n_points}, fused_softmax={self.fused_softmax}"
        )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGERS = (torch.int32, torch.int64)


def _tensor(name: str, t: object, rank: int, dims: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {dims}, got shape {tuple(t.shape)}")


def _size(name: str, t: Tensor, dim: int, expected: int, what: str, source: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name} has {t.shape[dim]} {what} (dim {dim} of shape {tuple(t.shape)}), "
            f"expected {expected} as in {source}"
        )
