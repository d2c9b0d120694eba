"""Pure-PyTorch MSDA: the path for CPU and every device without the Triton kernels.

Two implementations of the same operator, with explicit backwards (autograd does not run inside
an operator's body), and the same numerics: positions in float64 (float32 on MPS, which has no
float64), so the cell a sample falls in (and the location gradient, which jumps between cells)
matches an exact computation of `x * W - 0.5`; float32 accumulation (float64 for float64 inputs).

- On CPU tensors, in eager mode (`_cpu_forward`, `_cpu_backward`), ATen's CPU kernels for the
  three sparse products MSDA is made of: the output is a weighted sum of L*K*4 rows of `value` per
  query and head (F.embedding_bag, FBGEMM's kernel, a bag per corner); the gradients of the
  weights and locations need each corner's dot product with grad_output (the rows gathered a
  cache-sized chunk at a time); grad_value is the transposed sum (the corners sorted by row, then
  F.embedding_bag over grad_output's rows; where samples are dense, sorted by their top-left cell
  instead, a quarter of the keys: `_grad_value_by_cells`). The corners are computed a chunk of
  queries at a time, laid out corners-outermost so that the passes between them run long inner
  loops (`Samples`), and no (B, Q, M, L, K, D)-sized tensor is made. Under torch.compile the
  operator stays one node on CPU (msda/ops.py), which runs these kernels. A corner outside its
  level reads an in-range row with weight 0 instead of being skipped, so a non-finite number in
  `value` could reach the samples next to it as NaN: a call whose result holds a NaN is redone by
  the masked path below (`_masked_forward`, `_masked_backward`), which says which NaNs are real.
- Elsewhere (CUDA in deterministic mode, MPS, other devices, and any tracing of the body), gathers
  (index_select) and scatters (index_add_) over `value` viewed as rows of D channels, a corner at a
  time, so that it allocates no (B, Q, M, L, K, D)-sized index tensor and has no data-dependent
  Python control flow (torch.compile traces it with dynamic shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .validation import _is_eager_cpu


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64 (gradcheck), else float32 accumulation."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class Corner(NamedTuple):
    row: Tensor  # (B, Q, M, L, K) int64 row of value.view(B * S * M, D); 0 where masked
    inside: Tensor  # (B, Q, M, L, K) bool: the corner lies inside its level
    weight: Tensor  # bilinear weight wx * wy, 0 where masked
    dweight_dx: Tensor  # d weight / d x_im = sign_x * wy, 0 where masked
    dweight_dy: Tensor  # d weight / d y_im = sign_y * wx, 0 where masked
    wx: Tensor  # the weight's x factor (fx or 1 - fx), not masked: msda/derivatives.py's terms
    wy: Tensor  # its y factor
    sign_x: float  # d wx / d x_im: +1 for a right corner, -1 for a left one
    sign_y: float  # d wy / d y_im


def corners(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor, ctype: torch.dtype
) -> Iterator[Corner]:
    """The four corners of each sample's cell, placed as the kernels place samples (also what
    msda/derivatives.py differentiates)."""
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
    touches_level = (x >= -1) & (x < w) & (y >= -1) & (y < h)  # as the kernels: cells -1 .. W - 1
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
                wx=wx,
                wy=wy,
                sign_x=sign_x,
                sign_y=sign_y,
            )


def finite_weights(attention_weights: Tensor, ctype: torch.dtype) -> Tensor:
    """The weights in `ctype`, a non-finite one (+-inf, NaN) replaced by NaN: such a sample makes
    its (batch, query, head) output NaN whether or not it lands in its level, as the kernels do
    (docs/correctness.md, "Non-finite attention weights")."""
    attn = attention_weights.to(ctype)
    return torch.where(torch.isfinite(attn), attn, torch.nan)


def gather(rows_of_value: Tensor, corner: Corner, ctype: torch.dtype) -> Tensor:
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
    if _is_eager_cpu(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return _cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return _masked_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def _masked_forward(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:  # fmt: skip
    """The forward corner by corner, each outside corner's value masked to exactly 0."""
    B, _, M, D = value.shape
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    rows_of_value = value.reshape(-1, D)
    attn = finite_weights(attention_weights, ctype)
    out = torch.zeros((B, Q, M, D), dtype=ctype, device=value.device)
    for corner in corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        weighted = (attn * corner.weight).unsqueeze(-1) * gather(rows_of_value, corner, ctype)
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
    args = (grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if _is_eager_cpu(*args):
        return _cpu_backward(*args)
    return _masked_backward(*args)


def _masked_backward(
    grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
    sampling_locations: Tensor, attention_weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward corner by corner, each outside corner's value masked to exactly 0."""
    B, _, M, D = value.shape
    L = spatial_shapes.shape[0]
    Q = sampling_locations.shape[1]
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    rows_of_value = value.reshape(-1, D)
    attn = finite_weights(attention_weights, ctype)
    grad_out = grad_output.reshape(B, Q, M, 1, 1, D).to(ctype)

    grad_rows = torch.zeros(rows_of_value.shape, dtype=ctype, device=value.device)
    grad_attn = torch.zeros(attn.shape, dtype=ctype, device=value.device)
    grad_x = torch.zeros_like(grad_attn)
    grad_y = torch.zeros_like(grad_attn)
    for corner in corners(value, spatial_shapes, level_start_index, sampling_locations, ctype):
        # <grad_out, corner value>: everything but grad_value needs only this dot product.
        dot = (gather(rows_of_value, corner, ctype) * grad_out).sum(-1)
        grad_attn = grad_attn + corner.weight * dot
        grad_x = grad_x + corner.dweight_dx * dot
        grad_y = grad_y + corner.dweight_dy * dot
        # Only inside corners scatter: a NaN weight must not reach the row an outside corner
        # points at (row 0 of its batch and head).
        contribution = torch.where(corner.inside, attn * corner.weight, 0.0).unsqueeze(-1) * grad_out
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


# --- CPU ---------------------------------------------------------------------------------------

# Query rows (b * Q + q) are processed in chunks of about this many corners (4 * M * L * K each),
# so that the per-corner tensors stay in cache and the ATen calls stay few: each call of a chunk
# that ATen parallelizes wakes the other threads. 2**18 against 2**17: backwards 1-13% faster,
# forwards up to 29% (one cell 9% slower, won back by equal chunks: `_chunks`), the most where
# waking a thread is dear (bench/NOTES.md entry 81).
CORNERS_PER_CHUNK = 2**18
# grad_value is summed by each sample's top-left cell (a sort of a quarter of the keys, then four
# grad_value-sized sums, one a corner) where the corners are at least this many times the cells
# of the padded grids (`Levels`), and by each corner's row (a sort of every corner, one sum) where
# they are fewer: the four sums cost what the smaller sort saves at about 5 corners a cell (1.00-
# 1.02x at 5, 0.87x at 3, 1.09x at 7, 1.6x at Deformable DETR's encoders; bench/NOTES.md entry 95).
CELL_SUMS_MIN_CORNERS_PER_CELL = 5


class Levels(NamedTuple):
    """Per-level constants of one call, for each head and each of a query's L*K sample columns:
    laid out (..., M, L*K), so that they broadcast over the query rows alone and a pass over an
    (..., n, M, L*K) tensor runs inner loops of M*L*K elements (bench/NOTES.md entry 93)."""

    size: Tensor  # (2, 1, M, L*K) float64: (W, H), in the order of the locations' (x, y)
    far: Tensor  # (2, 1, M, L*K) float64: W + 2 and H + 2, where `_samples` clamps positions past the level
    last: Tensor  # (2, 1, 1, M, L*K) int: the last corner coordinate inside the level, W - 1 and H - 1
    stride: Tensor  # (2, 1, 1, M, L*K) int: rows of value.view(B*S*M, D) per step in x (M) and in y (W * M)
    head_rows: Tensor  # (M, L*K) int: the row of the level's first pixel for batch entry 0 and each head
    # The cells of each level's grid padded by 2 before and 1 after in x and y ((H + 3) x (W + 3):
    # every sample's top-left corner, floor() + 2 in [0, W + 2], lies on it), in rows of D like
    # value's: `_grad_value_by_cells`.
    cell_stride: Tensor  # (2, 1, M, L*K) int: rows per step in x (M) and in y ((W + 3) * M)
    cell_head_rows: Tensor  # (M, L*K) int: the row of the padded level's first cell for batch entry 0 and each head
    grids: tuple  # (H, W, start, padded start) of each level
    cells_per_batch: int  # (sum of (H + 3) * (W + 3)) * M
    rows_per_batch: int  # S * M
    queries: int  # Q


class Samples(NamedTuple):
    """The four corners of n query rows' samples, the corner axes outermost and the samples' own
    (n, M, L*K) innermost: a pass that combines one corner axis with the other then runs over
    whole (n, M, L*K) blocks, where corners laid out inside each (query, head) made inner loops of
    L*K elements, 2.7x (L*K = 16) to 12.6x (L*K = 4) slower (bench/NOTES.md entries 92-93)."""

    rows: Tensor  # (2 [corner y], 2 [corner x], n, M, L*K): the row of value.view(B*S*M, D), in range
    weight: Tensor  # (2 [x | y], 2 [corner 0 | 1], n, M, L*K): the 1-D bilinear weights 1 - f and f, 0 outside
    inside: Tensor  # (2 [x | y], 2 [corner 0 | 1], n, M, L*K): the corner coordinate lies inside the level
    cell: Tensor  # (2 [x | y], n, M, L*K) int: the top-left corner's coordinates + 2, in [0, W + 2]


class _Constants(NamedTuple):
    """The small constant tensors of `_samples` and `_cpu_backward`, made once per dtype pair:
    each ATen call costs microseconds, and a decoder's chunk makes only a few dozen (bench/NOTES.md
    entry 84). Shared between calls: never written."""

    one_and_a_half: Tensor  # float64 1.5
    zero: Tensor  # float64 0
    zero_index: Tensor  # 0 in the index dtype
    corner_offsets: Tensor  # (2, 1, 1, 1) index: the corners' coordinates from floor() + 2, -2 and -1
    weight_at_0: Tensor  # (2, 1, 1, 1) ctype: the corners' 1-D weights at f = 0, 1 and 0 ...
    weight_slope: Tensor  # (2, 1, 1, 1) ctype: ... and their slopes in f (and in position), -1 and +1


@functools.cache
def _constants(index: torch.dtype, ctype: torch.dtype) -> _Constants:
    def per_corner(pair, dtype) -> Tensor:
        return torch.tensor(pair, dtype=dtype).view(2, 1, 1, 1)

    return _Constants(
        one_and_a_half=torch.tensor(1.5, dtype=torch.float64),
        zero=torch.zeros((), dtype=torch.float64),
        zero_index=torch.zeros((), dtype=index),
        corner_offsets=per_corner([-2, -1], index),
        weight_at_0=per_corner([1.0, 0.0], ctype),
        weight_slope=per_corner([-1.0, 1.0], ctype),
    )


def _levels(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor) -> Levels:
    B, S, M, _ = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    # The levels as Python numbers (CPU tensors, which the operator has checked: reading them is free).
    heights, widths = zip(*spatial_shapes.tolist())
    starts = tuple(level_start_index.tolist())
    padded_starts = _padded_starts(heights, widths)
    cells_per_batch = padded_starts[-1] * M  # more than S * M: the padded grids hold every level
    # int32 rows when every row of value, every padded cell and every corner fits: FBGEMM and the
    # sort are faster.
    index = torch.int32 if max(B * cells_per_batch, 2 * sampling_locations.numel()) < 2**31 else torch.int64
    tensors = _level_tensors(heights, widths, starts, padded_starts, M, K, index)
    grids = tuple(zip(heights, widths, starts, padded_starts))
    return Levels(*tensors, grids=grids, cells_per_batch=cells_per_batch, rows_per_batch=S * M, queries=Q)


@functools.lru_cache(maxsize=64)
def _level_tensors(
    heights: tuple, widths: tuple, starts: tuple, padded_starts: tuple, M: int, K: int, index: torch.dtype
) -> tuple:
    """Levels' tensor fields, made from the levels' numbers once for each set of them (a few
    calls, where computing them from the tensors took a few dozen: bench/NOTES.md entry 84).
    Shared between calls: never written."""

    def per_sample(level_values) -> list:  # L values -> L*K, each repeated K times
        return [v for v in level_values for _ in range(K)]

    W, H = per_sample(widths), per_sample(heights)
    LK = len(W)

    def per_head(rows: list, dtype: torch.dtype) -> Tensor:  # R lists of L*K -> (R, 1, M, L*K)
        return torch.tensor(rows, dtype=dtype).view(len(rows), 1, 1, LK).expand(-1, 1, M, LK).contiguous()

    size = per_head([W, H], torch.float64)
    last_and_stride = per_head([[w - 1 for w in W], [h - 1 for h in H], [M] * LK, [w * M for w in W]], index)

    def rows_of_heads(level_starts) -> Tensor:  # (M, L*K): level_starts[l] * M + m
        return torch.tensor([[start * M + m for start in per_sample(level_starts)] for m in range(M)], dtype=index)

    cell_stride = per_head([[M] * LK, [(w + 3) * M for w in W]], index)
    return (
        size, size + 2, last_and_stride[0:2].unsqueeze(1), last_and_stride[2:4].unsqueeze(1), rows_of_heads(starts),
        cell_stride, rows_of_heads(padded_starts[:-1]),
    )


def _padded_starts(heights: tuple, widths: tuple) -> tuple:
    """The first cell of each level's padded grid ((H + 3) x (W + 3): `Levels`), and their total."""
    starts = [0]
    for h, w in zip(heights, widths):
        starts.append(starts[-1] + (h + 3) * (w + 3))
    return tuple(starts)


def _samples(levels: Levels, locations: Tensor, first: int, ctype: torch.dtype) -> Samples:
    """The corners of `locations`, (n, M, L*K, 2): query rows first .. first + n."""
    n, M, LK, _ = locations.shape
    index = levels.last.dtype
    constants = _constants(index, ctype)
    # Positions in pixels, pixel centres at integer + 0.5 (grid_sample's align_corners=False): the
    # cell is floor(x * W - 0.5). Computed as x * W + 1.5 in float64, exact for float32 locations,
    # so that every position kept is positive and its integer conversion is floor() + 2.
    # (2 [x, y], n, M, L*K), the axis outermost.
    xy = locations.permute(3, 0, 1, 2)
    p = torch.empty(xy.shape, dtype=torch.float64)
    f = torch.empty(p.shape, dtype=ctype)
    float64_locations = locations.dtype == torch.float64  # (then ctype is float64 too)
    if float64_locations:
        # A float64 x * W rounds (as the reference's product does), and + 1.5 after it would round
        # again, onto n + 2 for an x * W - 0.5 just under an integer n: the cell one too far.
        # floor(x * W - 0.5) first, then + 2, in exact steps.
        q = torch.mul(xy, levels.size).sub_(0.5)
        torch.floor(q, out=p)
        torch.sub(q, p, out=f).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # exact; unused outside
        p.add_(2.0)
    else:
        torch.addcmul(constants.one_and_a_half, xy, levels.size, out=p)
    # Far, infinite and NaN positions to 0 or W + 2: both corners outside, the conversion defined.
    torch.clamp(p, constants.zero, levels.far, out=p)
    p.nan_to_num_(nan=0.0)
    cell = p.to(index)
    if not float64_locations:
        torch.sub(p, cell, out=f)

    # (2 [x, y], 2 [corner], n, M, L*K): each corner's coordinate, clamped into the level for its
    # row (a corner outside reads an in-range row, with weight 0).
    corner = cell.unsqueeze(1) + constants.corner_offsets
    clamped = torch.clamp(corner, constants.zero_index, levels.last)
    inside = clamped == corner
    weight = torch.where(
        inside, torch.addcmul(constants.weight_at_0, f.unsqueeze(1), constants.weight_slope), 0.0
    )
    offset = clamped.mul_(levels.stride)
    # The row of each query row's level pixel 0, (b * S + start) * M + m.
    base = levels.head_rows + _batch_offset(levels, first, n, levels.rows_per_batch, index)  # (M or n x M, L*K)
    rows = (offset[1] + base).unsqueeze(1) + offset[0].unsqueeze(0)
    return Samples(rows=rows, weight=weight, inside=inside, cell=cell)


def _batch_offset(levels: Levels, first: int, n: int, per_batch: int, index: torch.dtype):
    """b * per_batch for query rows first .. first + n: one batch entry's number for a chunk inside
    one (the common case), else each query row's, (n, 1, 1)."""
    batch_first, batch_last = first // levels.queries, (first + n - 1) // levels.queries
    if batch_first == batch_last:
        return batch_first * per_batch
    batch = torch.arange(first, first + n, dtype=index).div_(levels.queries, rounding_mode="floor")
    return batch.mul_(per_batch).view(n, 1, 1)


def _top_left_cells(levels: Levels, samples: Samples, first: int) -> Tensor:
    """(n, M, L*K): the row of each sample's top-left cell in the padded grids of `Levels`."""
    n = samples.cell.shape[1]
    cells = (samples.cell * levels.cell_stride).sum(0, dtype=samples.cell.dtype)
    return cells.add_(levels.cell_head_rows).add_(_batch_offset(levels, first, n, levels.cells_per_batch, cells.dtype))


def _corner_products(samples: Samples, attn: Tensor) -> Tensor:
    """(2 [corner y], 2 [corner x], n, M, L*K): attention weight * bilinear weight of each corner,
    from the attention weights as (n, M, L*K); 0 on a corner outside its level where the
    attention weight is finite."""
    wx, wy = samples.weight[0], samples.weight[1]
    return (wy * attn).unsqueeze(1) * wx.unsqueeze(0)


def _corner_weights(samples: Samples, attn: Tensor) -> Tensor:
    """`_corner_products`, exactly 0 on a corner outside its level also for a NaN attention weight
    (whose NaN must reach only the rows its sample reads)."""
    inside = samples.inside[1].unsqueeze(1) & samples.inside[0].unsqueeze(0)
    return torch.where(inside, _corner_products(samples, attn), 0.0)


def _chunks(query_rows: int, corners_per_query_row: int) -> list[tuple[int, int]]:
    """(first, last) query rows of the fewest chunks of at most CORNERS_PER_CHUNK corners (a row at
    the least), equal in size but for rounding: a short last chunk cost the 2-thread 400x667
    decoder's forward at batch 2 a fifth of its time (bench/NOTES.md entry 82)."""
    most = max(1, CORNERS_PER_CHUNK // max(1, corners_per_query_row))  # query rows a chunk
    count = max(1, -(-query_rows // most))  # ceil: the fewest chunks
    step = max(1, -(-query_rows // count))  # ceil: as equal as they can be
    return [(first, min(query_rows, first + step)) for first in range(0, query_rows, step)]


def _flat_inputs(sampling_locations: Tensor, attention_weights: Tensor, ctype: torch.dtype):
    """Locations as (B*Q, M, L*K, 2) and attention weights as (B*Q, M, L*K) in ctype, as given
    (a non-finite one stays what it is: `_weights` makes it NaN where that is needed)."""
    B, Q, M, L, K, _ = sampling_locations.shape
    return sampling_locations.reshape(B * Q, M, L * K, 2), attention_weights.reshape(B * Q, M, L * K).to(ctype)


def _cpu_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> Tensor:
    B, _, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    levels = _levels(value, spatial_shapes, level_start_index, sampling_locations)
    # The weights as given: a non-finite one spoils only its own (batch, query, head) sum, which the
    # end makes NaN in any case (no `_weights` or `_corner_weights` here, whose passes took about a
    # fifth of the forward on a CPU: bench/NOTES.md entry 76).
    locations, attn = _flat_inputs(sampling_locations, attention_weights, ctype)
    rows_of_value = value.reshape(-1, D).to(ctype)
    out = torch.empty((B * Q, M * D), dtype=ctype)
    for first, last in _chunks(B * Q, M * 4 * L * K):
        samples = _samples(levels, locations[first:last], first, ctype)
        # A bag of F.embedding_bag for each corner of each query and head (its L*K samples, which
        # the corners-outermost layout keeps contiguous), then the four corners' sums added.
        bags = 4 * (last - first) * M
        corner_sums = F.embedding_bag(
            samples.rows.view(bags, L * K),
            rows_of_value,
            per_sample_weights=_corner_products(samples, attn[first:last]).view(bags, L * K),
            mode="sum",
        )
        torch.sum(corner_sums.view(4, -1), 0, out=out[first:last].view(-1))
    # A non-finite attention weight makes its (batch, query, head) NaN, inside its level or not:
    # w - w is 0 for a finite w and NaN otherwise, so each head adds 0 or NaN to its D channels.
    out.view(B * Q, M, D).add_((attn - attn).sum(-1, keepdim=True))
    if bool(torch.isnan(out.sum())):
        # An outside corner reads the nearest inside row with weight 0, and 0 * inf is NaN: where a
        # NaN came out (a non-finite value or weight, rare), the masked path says which are real.
        return _masked_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return out.view(B, Q, M * D).to(value.dtype)


def _corner_dots(rows_of_value: Tensor, rows: Tensor, grad: Tensor) -> Tensor:
    """(corners, bags, per_bag): <grad[bag], rows_of_value[rows[corner, bag, j]]>, which is the
    gradient of F.embedding_bag's per_sample_weights: ATen's kernel for it takes each dot straight
    from the two rows, in one parallel pass. Gathering the rows first (FBGEMM's gather), then
    multiplying and summing them, was three passes over a copy: backwards up to 22% slower with 2
    threads (even at the 800x1333 decoder's batch 2), 3-17% with 1 at 400x667, but 6-15% faster
    with 1 at 800x1333, where the gather's prefetches hide misses the dots wait on (bench/NOTES.md
    entry 110)."""
    # (Its indices must be contiguous: an expanded arange of one bag reshapes to a stride-0 view.)
    bag_of_corner = torch.arange(rows.shape[1], dtype=rows.dtype).view(1, -1, 1).expand(rows.shape).contiguous()
    dots = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad, rows_of_value, rows.contiguous().view(-1), bag_of_corner[:0, 0, 0], bag_of_corner.view(-1), 0
    )  # (offsets unused where offset2bag is given; mode 0: sum)
    return dots.view(rows.shape)


def _cpu_backward(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
) -> tuple[Tensor, Tensor, Tensor]:
    B, _, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    ctype = compute_dtype(value, sampling_locations, attention_weights)
    levels = _levels(value, spatial_shapes, level_start_index, sampling_locations)
    locations, attn = _flat_inputs(sampling_locations, attention_weights, ctype)
    # A corner outside its level has bilinear weight 0, so with finite attention weights its product
    # is 0 already. A non-finite weight must reach only the rows its sample's inside corners read:
    # made NaN, and the outside corners' products zeroed, two passes the common case skips (a CPU
    # call is eager: the check costs no device sync; bench/NOTES.md entry 77). The sum is finite
    # only if every weight is (one that overflows takes the other path, also right), and costs
    # less than isfinite and all over every weight (entry 82).
    finite = bool(torch.isfinite(attn.sum()))
    if not finite:
        attn = finite_weights(attn, ctype)
    corner_weights_of = _corner_products if finite else _corner_weights
    rows_of_value = value.reshape(-1, D).to(ctype)
    grad = grad_output.reshape(B * Q * M, D).to(ctype)
    LK = L * K
    size = levels.size.to(ctype)  # (2, 1, M, L*K): W and H
    slope_of = _constants(levels.last.dtype, ctype).weight_slope  # d weight / d position of corners 0, 1

    # Every corner's weight, (4 corners, B*Q*M bags, L*K), and every corner's row or every
    # sample's top-left cell (`_grad_value_by_rows`, `_grad_value_by_cells`): grad_value's sums at
    # the end.
    index = levels.last.dtype
    by_cells = 4 * B * Q * M * LK >= CELL_SUMS_MIN_CORNERS_PER_CELL * B * levels.cells_per_batch
    weights = torch.empty((4, B * Q * M, LK), dtype=ctype)
    keys = torch.empty(weights.shape[1:] if by_cells else weights.shape, dtype=index)
    grad_loc = torch.empty((B * Q, M, LK, 2), dtype=ctype)
    grad_attn = torch.empty((B * Q, M, LK), dtype=ctype)
    for first, last in _chunks(B * Q, M * 4 * LK):
        samples = _samples(levels, locations[first:last], first, ctype)
        chunk_attn = attn[first:last]
        bags = slice(first * M, last * M)
        corner_rows = samples.rows.view(4, -1, LK)
        if by_cells:
            keys[bags] = _top_left_cells(levels, samples, first).view(-1, LK)
        else:
            keys[:, bags] = corner_rows
        weights[:, bags] = corner_weights_of(samples, chunk_attn).view(4, -1, LK)

        # Each corner's dot product with grad_output, then the bilinear interpolation of those.
        dot = _corner_dots(rows_of_value, corner_rows, grad[bags]).view(samples.rows.shape)
        wx, wy = samples.weight[0], samples.weight[1]
        along_x = (dot * wy.unsqueeze(1)).sum(0)  # (2 [corner x], n, M, L*K): interpolated in y
        along_y = (dot * wx.unsqueeze(0)).sum(1)  # (2 [corner y], n, M, L*K): interpolated in x
        torch.sum(along_y * wy, 0, out=grad_attn[first:last])
        # d/d position: -1 and +1 for corners 0 and 1 (0 outside); then the chain rule through
        # x * W - 0.5 (and y * H - 0.5), and the attention weight.
        slope = torch.where(samples.inside, slope_of, 0.0)
        for axis, along in enumerate((along_x, along_y)):
            grad_position = (along * slope[axis]).sum(0).mul_(chunk_attn)
            torch.mul(grad_position, size[axis], out=grad_loc[first:last, :, :, axis])
    if bool(torch.isnan(grad_attn.sum())):
        # An outside corner's dot came from the nearest inside row (`_cpu_forward` says why that can
        # be NaN): a NaN in grad_attn, which every such NaN reaches, hands the call to the masked path.
        return _masked_backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights
        )

    if by_cells:
        grad_value = _grad_value_by_cells(levels, keys, weights, grad, B)
    else:
        grad_value = _grad_value_by_rows(keys, weights, grad, rows_of_value.shape[0])
    return (
        grad_value.view(value.shape).to(value.dtype),
        grad_loc.view(sampling_locations.shape).to(sampling_locations.dtype),
        grad_attn.view(attention_weights.shape).to(attention_weights.dtype),
    )


def _sorted_sums(keys: Tensor, weights: Tensor, grad: Tensor, rows: int) -> Iterator[Tensor]:
    """(rows, D) sums of weight * grad[bag] by key, the keys sorted once (a stable sort: the sums'
    order is fixed) and each key one bag of F.embedding_bag over grad's rows. `weights` is
    (corners, bags, L*K); `keys`, rows in [0, rows), is laid out like it (one sum, of every corner)
    or (bags, L*K), shared by the corners (a sum for each corner)."""
    index = keys.dtype
    flat = keys.view(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=rows)
    offsets = torch.zeros(rows + 1, dtype=index)
    torch.cumsum(counts, 0, out=offsets[1:])
    # Each key's bag (grad's row), in the keys' layout, picked in sorted order: in the index dtype,
    # a gather, a third of the time of an int64 division and remainder of `order` (entry 93).
    bag_of_key = torch.arange(weights.shape[1], dtype=index).view(-1, 1).expand(keys.shape)
    bag_of_sorted = bag_of_key.reshape(-1).index_select(0, order)
    slices = [weights] if keys.dim() == weights.dim() else weights.unbind(0)
    for weights_slice in slices:
        yield F.embedding_bag(
            bag_of_sorted,
            grad,
            offsets,
            per_sample_weights=weights_slice.reshape(-1).index_select(0, order),
            mode="sum",
            include_last_offset=True,
        )


def _grad_value_by_rows(rows: Tensor, weights: Tensor, grad: Tensor, value_rows: int) -> Tensor:
    """grad_value as (B*S*M, D): each row the sum of weight * grad_output[query and head] over the
    corners on it, from every corner's row and weight, (4, B*Q*M, L*K)."""
    return next(_sorted_sums(rows, weights, grad, value_rows))


def _grad_value_by_cells(levels: Levels, cells: Tensor, weights: Tensor, grad: Tensor, B: int) -> Tensor:
    """grad_value as (B, S, M, D), from each sample's top-left cell in the padded grids of `Levels`,
    (B*Q*M, L*K), and its corners' weights, (4, B*Q*M, L*K): the samples sorted by cell once, a
    quarter of the keys `_grad_value_by_rows` sorts; then for each corner the sums by top-left
    cell, shifted onto the corner's pixel (a cell's right corner is the pixel one step right of
    it), the padding, which takes every corner outside its level, left out."""
    M, D = levels.cell_head_rows.shape[0], grad.shape[1]
    grad_value = torch.empty((B, levels.rows_per_batch // M, M, D), dtype=grad.dtype)
    sums = _sorted_sums(cells, weights, grad, B * levels.cells_per_batch)
    for corner, by_cell in enumerate(sums):  # corners (y, x): (0, 0), (0, 1), (1, 0), (1, 1)
        dy, dx = divmod(corner, 2)
        by_cell = by_cell.view(B, levels.cells_per_batch // M, M, D)
        for h, w, start, padded_start in levels.grids:
            grid = by_cell[:, padded_start : padded_start + (h + 3) * (w + 3)].view(B, h + 3, w + 3, M, D)
            # Pixel (y, x) is this corner of cell (y - dy, x - dx), at (y - dy + 2, x - dx + 2) here.
            shifted = grid[:, 2 - dy : h + 2 - dy, 2 - dx : w + 2 - dx]
            level = grad_value[:, start : start + h * w].view(B, h, w, M, D)
            if corner == 0:
                level.copy_(shifted)
            else:
                level.add_(shifted)
    return grad_value


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
    return backward_through_softmax(
        backward, grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits
    )


def backward_through_softmax(
    plain_backward, grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_logits
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_value, grad_loc, grad_logits): `plain_backward` (any of the backwards on weights:
    this module's, msda::backward, the eager path's) on the softmax's weights, then the softmax
    backward (`softmax_grad`)."""
    weights = softmax_weights(attention_logits, value, sampling_locations)  # in the compute dtype
    grad_value, grad_loc, grad_weights = plain_backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, weights
    )
    return grad_value, grad_loc, softmax_grad(weights, grad_weights, attention_logits.dtype)


def softmax_grad(weights: Tensor, grad_weights: Tensor, dtype: torch.dtype) -> Tensor:
    """The logits' gradient from the softmax's weights p and their gradient g, (B, Q, M, L, K):
    p * (g - sum over the head's L * K samples of p * g), in `dtype`."""
    B, Q, M, L, K = weights.shape
    p = weights.view(B, Q, M, L * K)
    g = grad_weights.to(weights.dtype).view(B, Q, M, L * K)
    return (p * (g - (p * g).sum(dim=-1, keepdim=True))).view(B, Q, M, L, K).to(dtype)
