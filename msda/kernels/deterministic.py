"""The deterministic mode's grad_value without atomic adds on it (bench/NOTES.md entry 35).

Under torch.use_deterministic_algorithms(True) grad_value is summed in 64-bit fixed point
(backward.py: `fixed_point_scale`). The backward kernel could add the integers with atomics, but
PTX has no vector integer atomic: one 64-bit atomic a channel, four times the float32 path's
instructions. Instead each value row gathers its own contributions:

1. `msda_corner_lists_kernel` (COUNT) adds 1 to an int32 count per grad_value row (batch, pixel,
   head) for each sample corner landing there: integer adds, so the counts are the same in any
   order. A cumulative sum (torch.cumsum) gives each row's end in one list of all corners.
2. The same kernel (FILL) gives each corner a slot in its row's part of the list,
   `end - atomic_add(count, -1)`, and stores the sample's index times 4 plus the corner there.
   The slots' order within a row varies run to run.
3. `msda_gather_grad_value_kernel` takes ROWS rows a program, recomputes each listed corner's
   contribution (the backward kernel's arithmetic, bit for bit), rounds it to fixed point and
   sums the integers in registers: the same sum in any order, so the slot order does not
   matter, and the result is the atomic fixed-point path's to the bit. It writes grad_value
   once, in the value's dtype: nothing to zero.

The backward kernel computes the other two gradients as usual (GRAD_VALUE=False).
"""

import triton
import triton.language as tl

from .sampling import finite_or_nan, level_ok, place_sample


@triton.jit(do_not_specialize=["num_queries", "num_values"])
def msda_corner_lists_kernel(
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    counts_ptr,  # (B, S, M) int32: COUNT adds to zeros; FILL takes them back down to zeros
    ends_ptr,  # with FILL: (B * S * M,) the cumulative sum of the counts
    entries_ptr,  # with FILL: (B * Q * M * L * K * 4,) int32 or int64: the lists
    num_queries,
    num_values,
    NUM_HEADS: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,  # NUM_POINTS's next power of two
    COMPUTE: tl.constexpr,
    INDEX_64: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,  # False: sum the level sizes
    FILL: tl.constexpr,  # False: count the corners of each row; True: list them
):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    q_block = pid % num_q_blocks
    bm = pid // num_q_blocks
    b = bm // NUM_HEADS
    m = bm % NUM_HEADS
    q = (q_block * BLOCK_Q + tl.arange(0, BLOCK_Q))[:, None]
    point = tl.arange(0, BLOCK_K)[None, :]
    mask = (q < num_queries) & (point < NUM_POINTS)
    LK: tl.constexpr = NUM_LEVELS * NUM_POINTS
    first_param = ((b * num_queries + q) * NUM_HEADS + m) * LK + point  # [BLOCK_Q, BLOCK_K]
    start = b * 0
    for level in tl.range(0, NUM_LEVELS):
        h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
        w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
        if LEVEL_STARTS:
            start = tl.load(starts_ptr + level).to(b.dtype)
        param = first_param + level * NUM_POINTS
        x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
        y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
        x0, y0, _, _, left, right, top, bottom = place_sample(
            x, y, h, w, level_ok(h, w, start, num_values), mask, COMPUTE
        )
        row = (b * num_values + start + y0 * w + x0) * NUM_HEADS + m  # the top-left corner's
        _list_corner(counts_ptr, ends_ptr, entries_ptr, row, param * 4, left & top, FILL)
        _list_corner(counts_ptr, ends_ptr, entries_ptr, row + NUM_HEADS, param * 4 + 1, right & top, FILL)
        below = row + w * NUM_HEADS
        _list_corner(counts_ptr, ends_ptr, entries_ptr, below, param * 4 + 2, left & bottom, FILL)
        _list_corner(counts_ptr, ends_ptr, entries_ptr, below + NUM_HEADS, param * 4 + 3, right & bottom, FILL)
        if not LEVEL_STARTS:
            start += h * w


@triton.jit
def _list_corner(counts_ptr, ends_ptr, entries_ptr, row, entry, mask, FILL: tl.constexpr):
    """COUNT: one more corner on `row`; FILL: `entry` into a free slot of row's list."""
    if FILL:
        remaining = tl.atomic_add(counts_ptr + row, -1, mask=mask, sem="relaxed")
        slot = tl.load(ends_ptr + row, mask=mask, other=0) - remaining
        tl.store(entries_ptr + slot, entry.to(entries_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(counts_ptr + row, 1, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "num_rows"])
def msda_gather_grad_value_kernel(
    grad_out_ptr,  # (B, Q, M * D), channels contiguous
    grad_out_stride_b,
    grad_out_stride_q,
    shapes_ptr,  # (L, 2)
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous: the weights
    ends_ptr,  # (B * S * M,) int64: where each row's list ends
    entries_ptr,  # the lists (`msda_corner_lists_kernel`)
    inverse_scale_ptr,  # float32: 1 / fixed_point_scale
    fixed_point_scale_ptr,  # float32
    grad_value_ptr,  # (B, S, M, D) in the value's dtype: written whole
    num_queries,
    num_rows,  # B * S * M
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program, side by side in its tile
    BLOCK_E: tl.constexpr,  # list entries a row a step
    BLOCK_D: tl.constexpr,
    COMPUTE: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    # The last rows first: the coarse levels, at the end of each batch's rows, have the longest
    # lists. A program's ROWS rows are consecutive (a pixel's heads, then the next pixel's).
    row = (tl.cdiv(num_rows, ROWS) - 1 - pid) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = row < num_rows
    m = (row % NUM_HEADS)[:, None, None]
    channel = tl.arange(0, BLOCK_D)[None, None, :]
    d_ok = channel < HEAD_DIM
    LK: tl.constexpr = NUM_LEVELS * NUM_POINTS
    first = tl.load(ends_ptr + row - 1, mask=row_ok & (row > 0), other=0)
    end = tl.load(ends_ptr + row, mask=row_ok, other=0)
    scale = tl.load(fixed_point_scale_ptr)
    total = tl.zeros([ROWS, BLOCK_D], dtype=tl.int64)
    longest = tl.max(end - first, axis=0)
    done = longest * 0
    while done < longest:  # (a loop bound loaded from memory: a while loop, which the interpreter runs too)
        index = first[:, None] + done + tl.arange(0, BLOCK_E)[None, :]  # [ROWS, BLOCK_E]
        ok = index < end[:, None]
        entry = tl.load(entries_ptr + index, mask=ok, other=0)
        param = entry // 4
        corner = entry % 4
        level = (param // NUM_POINTS) % NUM_LEVELS
        h = tl.load(shapes_ptr + 2 * level, mask=ok, other=1)
        w = tl.load(shapes_ptr + 2 * level + 1, mask=ok, other=1)
        x = tl.load(loc_ptr + 2 * param, mask=ok, other=0.0)
        y = tl.load(loc_ptr + 2 * param + 1, mask=ok, other=0.0)
        attn = finite_or_nan(tl.load(attn_ptr + param, mask=ok, other=0.0).to(COMPUTE))
        # The backward kernel's arithmetic: the same fractions and weights, to the bit.
        _, _, fx, fy, _, _, _, _ = place_sample(x, y, h, w, ok, ok, COMPUTE)
        a_top = attn * (1.0 - fy)
        a_bottom = attn * fy
        weight = tl.where(
            corner < 2,
            tl.where(corner == 0, a_top * (1.0 - fx), a_top * fx),
            tl.where(corner == 2, a_bottom * (1.0 - fx), a_bottom * fx),
        )
        query = ((param // (NUM_HEADS * LK)) % num_queries)[:, :, None]
        batch = (param // (num_queries * NUM_HEADS * LK))[:, :, None]
        ok = ok[:, :, None] & d_ok
        grad_out = tl.load(
            grad_out_ptr + batch * grad_out_stride_b + query * grad_out_stride_q + m * HEAD_DIM + channel,
            mask=ok,
            other=0.0,
        ).to(COMPUTE)
        fixed = (weight[:, :, None] * grad_out * scale).to(tl.int64)
        total += tl.sum(tl.where(ok, fixed, 0), axis=1)
        done += BLOCK_E
    # backward.from_fixed_point's conversion: the integer rounded once to float32, times 2**-e.
    grad = total.to(tl.float32) * tl.load(inverse_scale_ptr)
    out = row[:, None] * HEAD_DIM + tl.arange(0, BLOCK_D)[None, :]
    tl.store(
        grad_value_ptr + out,
        grad.to(grad_value_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM),
    )
