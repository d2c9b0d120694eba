"""Triton helpers shared by the forward and backward kernels: where each sample lands.

A program owns BLOCK_Q queries of one (batch, head) pair. Its sampling parameters form a
[BLOCK_Q, BLOCK_LK] tile (all L*K points of each query, loaded once); each bilinear corner of
that tile is then a [BLOCK_Q, BLOCK_LK] tile of value rows, gathered D channels at a time.

These helpers take no pointers, and the kernels load their inputs themselves: torch.compile
decides which tensors a Triton kernel writes by tracing each store's address back through the
kernel's TTIR, and through a call it reaches every argument of the call. A helper that loaded
the locations and returned the value rows they point at made it believe the backward writes
`sampling_locations`, `attention_weights` and both index tensors: it then cloned them and copied
the clones back over the inputs (an error on a leaf that requires grad).
"""

import triton
import triton.language as tl


@triton.jit
def sample_indices(
    b,
    m,
    offs_q,
    lk_start,
    num_queries,
    num_heads,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_LK: tl.constexpr,
):
    """Which BLOCK_LK of the L*K samples of each query this step covers, from sample `lk_start`
    on: their level ([BLOCK_LK]) and its mask, their flat parameter index ([BLOCK_Q, BLOCK_LK])
    and its mask. Indices take the dtype of `b`: int64 when a tensor can pass 2**31 elements."""
    LK: tl.constexpr = NUM_LEVELS * NUM_POINTS
    offs_lk = lk_start + tl.arange(0, BLOCK_LK)
    lk_mask = offs_lk < LK
    level = offs_lk // NUM_POINTS
    mask = (offs_q < num_queries)[:, None] & lk_mask[None, :]
    param = ((b * num_queries + offs_q[:, None]) * num_heads + m) * LK + offs_lk[None, :]
    return level, lk_mask, param, mask


@triton.jit
def place_samples(x, y, h, w, mask, COMPUTE: tl.constexpr):
    """Place loaded locations (x, y) on their level of (h, w) [1, BLOCK_LK] pixels: the top-left
    corner (x0, y0) in the dtype of h, the fractions (fx, fy), and `touches`, whether the sample
    reaches the level at all."""
    # grid_sample's align_corners=False convention: pixel centres at integer + 0.5. In float64,
    # x * W - 0.5 is exact for float32 locations, so floor() picks the same cell as an exact
    # computation; in float32 about 1 sample in 1e5 lands in the neighbouring cell at the
    # presets, and the location gradient, which jumps between cells, missed 1e-5 (1.2e-3).
    wf = w.to(tl.float64)
    hf = h.to(tl.float64)
    # For float64 locations the product rounds, and the reference rounds it before subtracting.
    # An FMA of x * W - 0.5 would not, and on a pixel border (a kink of the bilinear weights)
    # could pick the other cell and the other one-sided location gradient. `+ 0.0` keeps the
    # product rounded: contracted or not, it is the rounded product (an FMA with a zero addend).
    x = (x.to(tl.float64) * wf + 0.0) - 0.5
    y = (y.to(tl.float64) * hf + 0.0) - 0.5
    # NaN compares false: a non-finite location touches nothing, and is zeroed before the
    # float-to-int conversion below, which is undefined for NaN, inf and huge values.
    touches = mask & (x > -1.0) & (x < wf) & (y > -1.0) & (y < hf)
    x = tl.where(touches, x, 0.0)
    y = tl.where(touches, y, 0.0)
    x0f = tl.floor(x)
    y0f = tl.floor(y)
    fx = (x - x0f).to(COMPUTE)
    fy = (y - y0f).to(COMPUTE)
    return x0f.to(h.dtype), y0f.to(h.dtype), fx, fy, touches


@triton.jit
def corner(
    x0,
    y0,
    fx,
    fy,
    h,
    w,
    start,
    touches,
    b,
    m,
    num_values,
    num_heads,
    DX: tl.constexpr,
    DY: tl.constexpr,
):
    """One bilinear corner: its value row, whether it is inside, its weight and the weight's
    derivatives in x_im and y_im. Where the corner is outside, the weights are finite but not
    zero: every use multiplies them by a value row loaded (or scattered) under `inside`, which
    makes the product zero, or NaN for non-finite operands either way. (Zeroing them with
    tl.where crashed triton 3.6's layout pass on forward tiles of 16 x 1 samples with 64-bit
    indices: the float32 preset beyond 2**31 elements.)"""
    xi = x0 + DX
    yi = y0 + DY
    pixel = start + yi * w + xi
    # The pixel bound also keeps an inconsistent level_start_index from reading out of bounds.
    inside = touches & (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h) & (pixel >= 0) & (pixel < num_values)
    # Where the corner is outside, `row` is a harmless unused address: every access is masked.
    row = (b * num_values + pixel) * num_heads + m
    if DX == 1:
        wx = fx
        dwx = 1.0
    else:
        wx = 1.0 - fx
        dwx = -1.0
    if DY == 1:
        wy = fy
        dwy = 1.0
    else:
        wy = 1.0 - fy
        dwy = -1.0
    return row, inside, wx * wy, dwx * wy, dwy * wx


def tile_sizes(
    num_levels: int, num_points: int, head_dim: int, target_elements: int, max_block_lk: int = 1 << 30
) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_LK, BLOCK_D): D padded to a power of two, L*K likewise but capped at
    `max_block_lk` samples a step, and as many queries as keep one corner's
    [BLOCK_Q, BLOCK_LK, BLOCK_D] tile near `target_elements`."""
    block_lk = min(triton.next_power_of_2(num_levels * num_points), triton.next_power_of_2(max_block_lk))
    block_d = triton.next_power_of_2(head_dim)
    block_q = max(1, min(64, target_elements // (block_lk * block_d)))
    return block_q, block_lk, block_d
