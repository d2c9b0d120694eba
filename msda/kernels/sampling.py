"""Triton helpers shared by the forward and backward kernels: where a sample lands, a value passed
between the threads of a row, and the softmax statistics of the softmax operators.

These helpers take no pointers, and the kernels load their inputs themselves: torch.compile
decides which tensors a Triton kernel writes by tracing each store's address back through the
kernel's TTIR, and through a call it reaches every argument of the call. A helper that loaded
the locations and returned the value rows they point at made it believe the backward writes
`sampling_locations`, `attention_weights` and both index tensors (bench/NOTES.md, entry 9).
The one exception, `softmax_stats`, loads the logits but returns no address: two numbers per
query, which no store's address is computed from (scripts/compile_check.py checks the analysis).
"""

import os

import torch
import triton
import triton.language as tl

if torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1":
    # libdevice's mul_rn (PTX mul.rn.f64), which neither LLVM nor ptxas fuses into an fma.
    # Imported by name: torch.compile's copy of the kernels then imports it too.
    from triton.language.extra.libdevice import mul_rn as rounded_product
else:
    # Triton's interpreter has no libdevice (and numpy never fuses). ROCm's has no mul_rn, and
    # Triton resolves every libdevice name a kernel's module holds, called or not, so there the
    # import above would fail every compile. Compiled for gfx942, triton 3.8 fuses this product
    # anyway (3.6 keeps it; docs/correctness.md); never run on an AMD GPU.

    @triton.jit
    def rounded_product(x, y):
        return x * y + 0.0


@triton.jit
def pixel_cell(x, size, COMPUTE: tl.constexpr):
    """The cell of a normalized coordinate `x` on an axis of `size` pixels (grid_sample's
    align_corners=False convention: x_im = x * size - 0.5, pixel centres at integer + 0.5).

    Returns (cell, frac, touches): cell = floor(x_im) as a float, frac = x_im - cell in [0, 1],
    and whether the sample reaches the axis at all (-1 <= cell <= size - 1; false for NaN/inf).

    The cell is exact, as if x_im were computed without rounding: the location gradient jumps
    between cells, so a cell picked by a rounded x_im (float32 rounding sends about 1 sample in
    1e5 across a border at the presets) misses the float64 oracle by 1e-3. In float32 that costs
    no float64: fma(x, size, -0.5) rounds x_im once, so its floor can be one too high only where
    x_im rounded up onto an integer; the residual fma(x, size, -(cell + 0.5)) is the exact
    x * size - 0.5 - cell rounded once, so its sign is exact, and it is the fraction itself.
    float64 inputs (gradcheck's) round the product first, as the float64 reference does.
    """
    size = size.to(COMPUTE)
    if COMPUTE == tl.float64:
        # The product rounded, then 0.5 off: what the reference computes in float64. Fused into
        # fma(x, size, -0.5), the product's rounding is lost, and a sample whose product rounds
        # onto a cell border (x = 1/6 of 3 pixels) lands in the cell before it: the location
        # gradient of the other side. Triton 3.8's LLVM fuses even `x * size + 0.0 - 0.5` so.
        x_im = rounded_product(x, size) - 0.5
        cell = tl.floor(x_im)
        frac = x_im - cell
    else:
        cell = tl.floor(tl.fma(x, size, -0.5))
        residual = tl.fma(x, size, -0.5 - cell)  # -0.5 - cell is exact, and one FADD
        below = residual < 0.0
        cell = tl.where(below, cell - 1.0, cell)
        frac = tl.where(below, residual + 1.0, residual)
    # NaN compares false: a non-finite location touches nothing.
    touches = (cell >= -1.0) & (cell <= size - 1.0)
    return cell, frac, touches


@triton.jit
def place_sample(x, y, h, w, level_ok, mask, COMPUTE: tl.constexpr):
    """A sample's top-left corner (x0, y0) as integers in the dtype of h, its fractions, and the
    masks of its four corners (x0 or x0 + 1 inside the width, y0 or y0 + 1 inside the height;
    all false where the sample misses the level, is masked off, or its level is unusable)."""
    cx, fx, touch_x = pixel_cell(x.to(COMPUTE), w, COMPUTE)
    cy, fy, touch_y = pixel_cell(y.to(COMPUTE), h, COMPUTE)
    touches = mask & level_ok & touch_x & touch_y
    # Float-to-int conversion is undefined for NaN, inf and huge values: zero them first. The
    # fractions too: every corner of a sample that misses is masked, but a NaN fraction (of a
    # non-finite location) would still make its weight, times the masked row's 0, NaN.
    x0 = tl.where(touches, cx, 0.0).to(h.dtype)
    y0 = tl.where(touches, cy, 0.0).to(h.dtype)
    fx = tl.where(touches, fx, 0.0)
    fy = tl.where(touches, fy, 0.0)
    left = touches & (x0 >= 0)
    right = touches & (x0 < w - 1)
    top = y0 >= 0
    bottom = y0 < h - 1
    return x0, y0, fx, fy, left, right, top, bottom


@triton.jit
def placed_corner_rows(
    x, y, h, w, start, b, m, num_values, ok, NUM_HEADS: tl.constexpr, ROW_ELEMENTS: tl.constexpr,
    PACK_CORNERS: tl.constexpr,
):  # fmt: skip
    """A sample as the lane placement passes it round its row: (row, below, corners, fx, fy).
    row is the top-left corner's value row (its index in (B, S, M) rows) and below the row under
    it; corners has bits 1, 2, 4 and 8 set where the top-left, top-right, bottom-left and
    bottom-right corners are inside (none where the sample misses or is not `ok`). With
    PACK_CORNERS row and below are offsets in ROW_ELEMENTS-wide rows, a multiple of 16, and
    corners rides in row's four low bits: one number less to pass."""
    x0, y0, fx, fy, left, right, top, bottom = place_sample(
        x, y, h, w, level_ok(h, w, start, num_values), ok, tl.float32
    )
    row = (b * num_values + start + y0 * w + x0) * NUM_HEADS + m
    below = row + w * NUM_HEADS
    corners = (left & top).to(tl.int32) | ((right & top).to(tl.int32) << 1)
    corners |= ((left & bottom).to(tl.int32) << 2) | ((right & bottom).to(tl.int32) << 3)
    if PACK_CORNERS:
        row = row * ROW_ELEMENTS | corners
        below = below * ROW_ELEMENTS
    return row, below, corners, fx, fy


@triton.jit
def lane_tile(q, LANES: tl.constexpr, GROUPS: tl.constexpr, LANE_AXIS: tl.constexpr):
    """The lane placement's tile indices (lane, group, query), each along its own axis of the
    4-D tile, whose last axis is a thread's vector of channels: [LANES, GROUPS, BLOCK_Q, vector]
    with LANE_AXIS 0, [GROUPS, BLOCK_Q, LANES, vector] with LANE_AXIS 2. q: the program's
    [BLOCK_Q] queries. Which of the two puts a row's LANES threads on consecutive lanes of a
    warp depends on how a triton release breaks ties between axes as it lays out the gathers:
    `launch.LANE_AXIS` picks it per release."""
    if LANE_AXIS == 0:
        lane = tl.arange(0, LANES)[:, None, None, None]
        group = tl.arange(0, GROUPS)[None, :, None, None]
        query = q[None, None, :, None]
    else:
        tl.static_assert(LANE_AXIS == 2, "the lane axis is the tile's first or third")
        lane = tl.arange(0, LANES)[None, None, :, None]
        group = tl.arange(0, GROUPS)[:, None, None, None]
        query = q[None, :, None, None]
    return lane, group, query


@triton.jit
def from_lane(x, k, LANE_AXIS: tl.constexpr, SHUFFLE: tl.constexpr):
    """Each thread's copy of `x` as held by lane k of its row: `x` is the lane placement's tile
    (`lane_tile`) with one element a vector. A gather along the lane axis, which Triton lowers to
    one warp shuffle where that axis lies over consecutive lanes of a warp, and to a slower but
    still correct exchange in any other layout: a triton that lays the tile out otherwise costs
    time, never a wrong result (scripts/compile_check.py reads what each release does).
    SHUFFLE (triton 3.6, `launch.SHUFFLE_TRITON`): one PTX shfl.sync in segments of the lane
    axis's size instead, right only in the layout compile_check finds there, as 3.6 lowers a
    gather across all 32 lanes of a warp (rows of 128 float32) through shared memory."""
    if SHUFFLE:
        tl.static_assert(LANE_AXIS == 0, "the shuffles' segments are the lowest lane bits: lanes first")
        SEGMENTS: tl.constexpr = ((32 - x.shape[0]) << 8) | 31  # shfl's c operand: segments of the lane axis
        return tl.inline_asm_elementwise(
            f"shfl.sync.idx.b32 $0, $1, $2, {SEGMENTS}, -1;", "=r,r,r", [x, tl.zeros(x.shape, tl.int32) + k],
            dtype=x.dtype, is_pure=True, pack=1,
        )  # fmt: skip
    return tl.gather(x, tl.zeros(x.shape, tl.int32) + k, axis=LANE_AXIS)


@triton.jit
def weight_offsets(param, ok):
    """The lane placement's offsets of its samples' weights (0 where not `ok`, masked there). A
    select, which hides from Triton that consecutive groups' weights are adjacent: seeing it, it
    loads (and stores) them in a layout of their own and, on 3.7 and 3.8, exchanges them into
    the tile's through shared memory every round (bench/NOTES.md entry 105)."""
    return tl.where(ok, param, 0)


@triton.jit
def level_ok(h, w, start, num_values):
    """Whether level rows start .. start + h * w lie inside value: an inconsistent
    level_start_index (not checked on CUDA: it would cost a host sync) must not read outside."""
    return (start >= 0) & (start + h * w <= num_values) & (h > 0) & (w > 0)


@triton.jit
def finite_or_nan(a):
    """A non-finite attention weight becomes NaN, so its (query, head) output is NaN whatever
    its corners (inf * 0 on an outside corner is NaN, inf * v inside is inf: NaN in both)."""
    return tl.where(a - a == 0.0, a, float("nan"))


@triton.jit
def softmax_stats(
    logits_ptr,
    first_param,
    q_ok,
    group,
    NUM_LOGITS: tl.constexpr,  # L * K
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """(row_max, row_scale), [1, BLOCK_Q] each: the largest of each query's NUM_LOGITS logits
    (at first_param, contiguous) and 1 / sum(exp(logit - row_max)), so that a sample's softmax
    weight is exp(logit - row_max) * row_scale. Two passes over the logits (they are few, and
    in L1 the second time), in the kernels' [GROUPS, BLOCK_Q] tile, reduced over the groups.

    (An H200 run once gave NaN everywhere with it; the cause was elsewhere: bench/NOTES.md entry 18.)

    torch.softmax's semantics: a -inf logit gets weight 0; a row of -inf only (-inf - -inf), or
    one with a +inf (inf - inf) or a NaN, sums to NaN, so all its weights are NaN. Logits past
    the row (masked) are -inf: they add exp(-inf) = 0."""
    BLOCK_Q: tl.constexpr = first_param.shape[1]
    largest = tl.full([GROUPS, BLOCK_Q], float("-inf"), COMPUTE)
    for step in tl.range(0, NUM_LOGITS, GROUPS * UNROLL):
        for unrolled in tl.static_range(UNROLL):
            j = step + unrolled * GROUPS + group  # [GROUPS, 1]
            mask = (j < NUM_LOGITS) & q_ok
            x = tl.load(logits_ptr + first_param + j, mask=mask, other=float("-inf")).to(COMPUTE)
            largest = tl.maximum(largest, x)
    # Queries past the end (masked, never stored) get 0 and 1: no -inf - -inf or 1 / 0 there.
    row_max = tl.where(q_ok, tl.max(largest, axis=0, keep_dims=True), 0.0)
    total = tl.zeros([GROUPS, BLOCK_Q], dtype=COMPUTE)
    for step in tl.range(0, NUM_LOGITS, GROUPS * UNROLL):
        for unrolled in tl.static_range(UNROLL):
            j = step + unrolled * GROUPS + group
            mask = (j < NUM_LOGITS) & q_ok
            x = tl.load(logits_ptr + first_param + j, mask=mask, other=float("-inf")).to(COMPUTE)
            total += tl.where(mask, tl.exp(x - row_max), 0.0)
    row_sum = tl.where(q_ok, tl.sum(total, axis=0, keep_dims=True), 1.0)
    return row_max, 1.0 / row_sum
