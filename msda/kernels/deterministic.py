"""The deterministic mode's grad_value without atomic adds on it (bench/NOTES.md entry 35).

Under torch.use_deterministic_algorithms(True) grad_value is summed in 64-bit fixed point
(backward.py: `fixed_point_scale`). The backward kernel could add the integers with atomics, but
PTX has no vector integer atomic: one 64-bit atomic a channel, four times the float32 path's
instructions. Instead each value row gathers its own contributions:

1. `msda_corner_lists_kernel` (COUNT) adds 1 to an int32 count per grad_value row (batch, pixel,
   head) for each sample corner landing there: integer adds, so the counts are the same in any
   order. A cumulative sum (torch.cumsum) gives each row's end in one list of all corners.
2. The same kernel (FILL) gives each corner a slot in its row's part of the list,
   `end - atomic_add(count, -1)`, and stores the sample's index times 4 plus the corner there;
   it also writes every corner's bilinear weight times the attention weight (the backward
   kernel's arithmetic, bit for bit) to a dense array at that same index. The slots' order
   within a row varies run to run.
3. `msda_gather_grad_value_kernel` takes ROWS rows a program and walks their lists ENTRIES
   entries a step (independent loads, in flight together): each entry's weight times its
   query's grad_output row, rounded to fixed point, summed as integers in registers: the same
   sum in any order, so the slot order does not matter, and the result is the atomic
   fixed-point path's to the bit. It writes grad_value once, in the value's dtype: nothing to
   zero.

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
    attn_ptr,  # with FILL: (B, Q, M, L, K), contiguous: the weights
    counts_ptr,  # (B, S, M) int32: COUNT adds to zeros; FILL takes them back down to zeros
    ends_ptr,  # with FILL: (B * S * M,) the cumulative sum of the counts
    entries_ptr,  # with FILL: (B * Q * M * L * K * 4,) int32 or int64: the lists
    weights_ptr,  # with FILL: (B * Q * M * L * K * 4,) in COMPUTE: each corner's weight
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
    COUNT_STRIDE: tl.constexpr,  # counters this many int32 apart (launch.LIST_COUNT_STRIDE says why)
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
    NEXT_PIXEL: tl.constexpr = NUM_HEADS * COUNT_STRIDE  # from a row's counter to the next pixel's (same head)
    start = b * 0
    for level in tl.static_range(NUM_LEVELS):  # unrolled: the levels' atomics in flight together
        h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
        w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
        if LEVEL_STARTS:
            start = tl.load(starts_ptr + level).to(b.dtype)
        param = first_param + level * NUM_POINTS
        x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
        y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
        x0, y0, fx, fy, left, right, top, bottom = place_sample(
            x, y, h, w, level_ok(h, w, start, num_values), mask, COMPUTE
        )
        row = (b * num_values + start + y0 * w + x0) * NUM_HEADS + m  # the top-left corner's
        below = row + w * NUM_HEADS
        entry = param * 4
        if FILL:
            # The backward kernel's products, in its order: the same bits.
            attn = finite_or_nan(tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE))
            a_top = attn * (1.0 - fy)
            a_bottom = attn * fy
            # Dense, at each corner's entry: coalesced stores here (written at the slots, beside
            # the entries, the fill ran 12-19% longer and the gather 8% shorter on the H200).
            tl.store(weights_ptr + entry, a_top * (1.0 - fx), mask=mask)
            tl.store(weights_ptr + entry + 1, a_top * fx, mask=mask)
            tl.store(weights_ptr + entry + 2, a_bottom * (1.0 - fx), mask=mask)
            tl.store(weights_ptr + entry + 3, a_bottom * fx, mask=mask)
        counter = row * COUNT_STRIDE
        below_counter = below * COUNT_STRIDE
        _list_corner(counts_ptr, ends_ptr, entries_ptr, counter, row, entry, left & top, FILL)
        _list_corner(counts_ptr, ends_ptr, entries_ptr, counter + NEXT_PIXEL, row + NUM_HEADS, entry + 1, right & top,
                     FILL)  # fmt: skip
        _list_corner(counts_ptr, ends_ptr, entries_ptr, below_counter, below, entry + 2, left & bottom, FILL)
        _list_corner(counts_ptr, ends_ptr, entries_ptr, below_counter + NEXT_PIXEL, below + NUM_HEADS, entry + 3,
                     right & bottom, FILL)  # fmt: skip
        if not LEVEL_STARTS:
            start += h * w


@triton.jit
def _list_corner(counts_ptr, ends_ptr, entries_ptr, counter, row, entry, mask, FILL: tl.constexpr):
    """COUNT: one more corner on `row` (its counter at `counter`); FILL: `entry` into a free
    slot of row's list."""
    if FILL:
        remaining = tl.atomic_add(counts_ptr + counter, -1, mask=mask, sem="relaxed")
        slot = tl.load(ends_ptr + row, mask=mask, other=0) - remaining
        tl.store(entries_ptr + slot, entry.to(entries_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(counts_ptr + counter, 1, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "num_rows"])
def msda_gather_grad_value_kernel(
    grad_out_ptr,  # (B, Q, M * D), channels contiguous
    grad_out_stride_b,
    grad_out_stride_q,
    ends_ptr,  # (B * S * M,) int64: where each row's list ends
    entries_ptr,  # the lists (`msda_corner_lists_kernel`)
    weights_ptr,  # each corner's weight, at its entry
    inverse_scale_ptr,  # float32: 1 / fixed_point_scale
    fixed_point_scale_ptr,  # float32
    grad_value_ptr,  # (B, S, M, D) in the value's dtype: written whole
    num_queries,
    num_rows,  # B * S * M
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program
    ENTRIES: tl.constexpr,  # list entries a row a step, unrolled: their loads in flight together
    BLOCK_D: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    # The last rows first: the coarse levels, at the end of each batch's rows, have the longest
    # lists. A program's ROWS rows are consecutive (a pixel's heads, then the next pixel's).
    row = (tl.cdiv(num_rows, ROWS) - 1 - pid) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = row < num_rows
    channel = tl.arange(0, BLOCK_D)[None, :]
    d_ok = channel < HEAD_DIM
    head_channel = (row % NUM_HEADS)[:, None] * HEAD_DIM + channel  # [ROWS, BLOCK_D]
    first = tl.load(ends_ptr + row - 1, mask=row_ok & (row > 0), other=0)
    end = tl.load(ends_ptr + row, mask=row_ok, other=0)
    scale = tl.load(fixed_point_scale_ptr)
    total = tl.zeros([ROWS, BLOCK_D], dtype=tl.int64)
    longest = tl.max(end - first, axis=0)
    done = longest * 0
    ENTRIES_A_QUERY: tl.constexpr = 4 * NUM_HEADS * NUM_LEVELS * NUM_POINTS
    while done < longest:  # (a loop bound loaded from memory: a while loop, which the interpreter runs too)
        for e in tl.static_range(ENTRIES):
            index = first + done + e
            ok = index < end
            entry = tl.load(entries_ptr + index, mask=ok, other=0)
            weight = tl.load(weights_ptr + entry, mask=ok, other=0.0)
            query = entry // ENTRIES_A_QUERY  # batch * num_queries + q
            batch = query // num_queries
            grad_out = tl.load(
                grad_out_ptr
                + (batch * grad_out_stride_b + (query - batch * num_queries) * grad_out_stride_q)[:, None]
                + head_channel,
                mask=ok[:, None] & d_ok,
                other=0.0,
            ).to(weight.dtype)
            # The backward kernel's fixed point: round-toward-zero(weight * grad_out * scale).
            total += (weight[:, None] * grad_out * scale).to(tl.int64)
        done += ENTRIES
    # backward.from_fixed_point's conversion: the integer rounded once to float32, times 2**-e.
    grad = total.to(tl.float32) * tl.load(inverse_scale_ptr)
    tl.store(
        grad_value_ptr + row[:, None] * HEAD_DIM + channel,
        grad.to(grad_value_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )
