"""The MSDA forward kernel."""

import triton
import triton.language as tl

from .sampling import finite_or_nan, level_ok, place_sample


@triton.jit
def _sample_level(
    acc,
    start,
    level,
    value_ptr,
    shapes_ptr,
    starts_ptr,
    loc_ptr,
    attn_ptr,
    b,
    m,
    first_param,
    q_ok,
    group,
    channel,
    num_values,
    row_max,
    row_sum,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    COMPUTE: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,
    SOFTMAX: tl.constexpr,
):
    """Add the level's samples to `acc`; returns it and the next level's first row. With
    SOFTMAX, attn_ptr holds logits: an online softmax per thread group, row_max and row_sum
    ([GROUPS, BLOCK_Q]) the largest logit the group has seen and its sum of exp(logit - row_max),
    acc rescaled whenever the largest grows; returns them too (the kernel combines the groups)."""
    ROW: tl.constexpr = NUM_HEADS * HEAD_DIM  # elements between horizontally adjacent pixels
    h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
    w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
    if LEVEL_STARTS:
        start = tl.load(starts_ptr + level).to(b.dtype)
    usable = level_ok(h, w, start, num_values)
    level_row = (b * num_values + start) * NUM_HEADS + m
    d_ok = channel < HEAD_DIM
    for point_step in tl.range(0, NUM_POINTS, GROUPS * UNROLL):
        for unrolled in tl.static_range(UNROLL):
            point = point_step + unrolled * GROUPS + group  # [GROUPS, 1]
            mask = (point < NUM_POINTS) & q_ok
            param = first_param + level * NUM_POINTS + point  # [GROUPS, BLOCK_Q]
            if SOFTMAX:  # masked logits -inf: weight exactly 0
                logit = tl.load(attn_ptr + param, mask=mask, other=float("-inf")).to(COMPUTE)
                new_max = tl.maximum(row_max, logit)
                # Nothing but -inf seen yet: rescale by 1 and weigh 0 (not -inf - -inf = NaN). A
                # +inf or NaN logit makes its weight NaN, and so the query's output (torch.softmax).
                seen = new_max != float("-inf")
                rescale = tl.where(seen, tl.exp(row_max - new_max), 1.0)
                attn = tl.where(seen, tl.exp(logit - new_max), 0.0)
                acc = acc * rescale[:, :, None, None]
                row_sum = row_sum * rescale + attn
                row_max = new_max
            else:
                attn = tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE)
            # x and y interleave: one 8-byte load for both.
            xy = tl.load(
                loc_ptr + 2 * param[:, :, None] + tl.arange(0, 2)[None, None, :], mask=mask[:, :, None], other=0.0
            )
            x, y = tl.split(xy)
            x0, y0, fx, fy, left, right, top, bottom = place_sample(x, y, h, w, usable, mask, COMPUTE)
            if not SOFTMAX:  # a softmax weight, exp(logit - running max), is finite or NaN already
                attn = finite_or_nan(attn)
            attn_top = attn * (1.0 - fy)
            attn_bottom = attn * fy
            # Element offset of the top-left corner's row; the others are ROW and w * ROW away.
            # Where a corner is outside, its offset is unused: every access through it is masked.
            corner = (level_row + (y0 * w + x0) * NUM_HEADS) * HEAD_DIM
            corner = corner[:, :, None, None] + channel
            below = corner + w * ROW
            v = tl.load(value_ptr + corner, mask=(left & top)[:, :, None, None] & d_ok, other=0.0)
            acc += (attn_top * (1.0 - fx))[:, :, None, None] * v.to(COMPUTE)
            v = tl.load(value_ptr + corner + ROW, mask=(right & top)[:, :, None, None] & d_ok, other=0.0)
            acc += (attn_top * fx)[:, :, None, None] * v.to(COMPUTE)
            v = tl.load(value_ptr + below, mask=(left & bottom)[:, :, None, None] & d_ok, other=0.0)
            acc += (attn_bottom * (1.0 - fx))[:, :, None, None] * v.to(COMPUTE)
            v = tl.load(value_ptr + below + ROW, mask=(right & bottom)[:, :, None, None] & d_ok, other=0.0)
            acc += (attn_bottom * fx)[:, :, None, None] * v.to(COMPUTE)
    return acc, start + h * w, row_max, row_sum


# Q and S vary with the image: not specialized (16-divisibility would compile a second program).
@triton.jit(do_not_specialize=["num_queries", "num_values"])
def msda_forward_kernel(
    value_ptr,  # (B, S, M, D), contiguous
    shapes_ptr,  # (L, 2) int32/int64
    starts_ptr,  # (L,) int32/int64, read if LEVEL_STARTS
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous: the weights, or with SOFTMAX the logits
    out_ptr,  # (B, Q, M * D), contiguous
    num_queries,
    num_values,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # queries per program
    GROUPS: tl.constexpr,  # the points of a level are split among this many thread groups
    UNROLL: tl.constexpr,  # points per group unrolled in one loop step
    CHUNK: tl.constexpr,  # channels one load of a row covers, across the threads of that row
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    LEVELS_UNROLLED: tl.constexpr,  # unroll the level loop (few samples: loads issue earlier)
    COMPUTE: tl.constexpr,  # tl.float32, or tl.float64 for float64 inputs
    INDEX_64: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,  # False: level_start_index was not given, sum the level sizes
    SOFTMAX: tl.constexpr,  # attn_ptr holds logits: weights are their softmax over the L * K samples
):
    # One program: BLOCK_Q queries of one (batch, head); neighbouring programs take the next
    # queries of the same head, so the programs that share an SM share that head's value rows
    # in L1. The flat 1-D grid has no 65535 limit on B * M.
    pid = tl.program_id(0)
    if INDEX_64:  # every index below derives from pid: 64-bit where a tensor passes 2**31 elements
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    bm = pid // num_q_blocks
    b = bm // NUM_HEADS
    m = bm % NUM_HEADS
    q = (pid % num_q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = (q < num_queries)[None, :]
    group = tl.arange(0, GROUPS)[:, None]

    # The gathered tile is [GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK]. Triton gives threads to the
    # contiguous last axis (16 bytes each), then to the groups and queries, and leaves the chunk
    # axis to each thread's registers: a row is read by CHUNK / vector threads, each holding
    # BLOCK_D / CHUNK vectors of it.
    channel = tl.arange(0, BLOCK_D // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    channel = channel[None, None, :, :]
    first_param = ((b * num_queries + q[None, :]) * NUM_HEADS + m) * (NUM_LEVELS * NUM_POINTS)  # [1, BLOCK_Q]

    # With SOFTMAX: each thread group's running max and sum of the logits it has weighed (an
    # online softmax, one pass over the logits). The statistics of a separate first pass came out
    # of their reduction in a layout Triton then converted the loop's tensors to and back through
    # shared memory on every step (bench/NOTES.md entry 18); these stay in the loop's layout.
    row_max = tl.full([GROUPS, BLOCK_Q], float("-inf"), COMPUTE)
    row_sum = tl.zeros([GROUPS, BLOCK_Q], dtype=COMPUTE)

    acc = tl.zeros([GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK], dtype=COMPUTE)
    start = b * 0  # the level's first row, in the index dtype
    # A loop over levels, unrolled only where there are few samples in all: compile time grows
    # with the unrolled samples.
    if LEVELS_UNROLLED:
        for level in tl.static_range(NUM_LEVELS):
            acc, start, row_max, row_sum = _sample_level(
                acc, start, level, value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, b, m, first_param, q_ok,
                group, channel, num_values, row_max, row_sum, NUM_HEADS, HEAD_DIM, NUM_POINTS, GROUPS, UNROLL,
                COMPUTE, LEVEL_STARTS, SOFTMAX,
            )  # fmt: skip
    else:
        for level in tl.range(0, NUM_LEVELS):
            acc, start, row_max, row_sum = _sample_level(
                acc, start, level, value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, b, m, first_param, q_ok,
                group, channel, num_values, row_max, row_sum, NUM_HEADS, HEAD_DIM, NUM_POINTS, GROUPS, UNROLL,
                COMPUTE, LEVEL_STARTS, SOFTMAX,
            )  # fmt: skip

    if SOFTMAX:  # the groups' sums brought to the query's largest logit, then normalized
        largest = tl.max(row_max, axis=0, keep_dims=True)  # [1, BLOCK_Q]
        # A group that saw only -inf adds 0 (no -inf - -inf); all -inf: 0 / 0 = NaN, as torch.softmax.
        group_scale = tl.where(row_max == float("-inf"), 0.0, tl.exp(row_max - largest))
        acc = acc * group_scale[:, :, None, None]
        total = tl.sum(row_sum * group_scale, axis=0)  # [BLOCK_Q]
    out = tl.sum(acc, axis=0)  # [BLOCK_Q, BLOCK_D // CHUNK, CHUNK]
    if SOFTMAX:
        out = out / total[:, None, None]
    out_row = (b * num_queries + q) * NUM_HEADS + m
    out_channel = tl.arange(0, BLOCK_D // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    tl.store(
        out_ptr + out_row[:, None, None] * HEAD_DIM + out_channel[None, :, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(q < num_queries)[:, None, None] & (out_channel < HEAD_DIM)[None, :, :],
    )
