"""The MSDA forward kernel."""

import triton
import triton.language as tl

from .sampling import (
    finite_or_nan,
    from_lane,
    lane_tile,
    level_ok,
    place_sample,
    placed_corner_rows,
    weight_offsets,
)


@triton.jit
def _step_params(
    step,
    loc_ptr,
    attn_ptr,
    first_param,
    q_ok,
    group,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    SOFTMAX: tl.constexpr,
):
    """The weights (with SOFTMAX the logits) and interleaved (x, y) of a loop step's points,
    ([GROUPS, BLOCK_Q], [GROUPS, BLOCK_Q, 2]) for the first and the second of its UNROLL (1 or 2)
    points (with UNROLL 1 the second is the first again, unused). A step is one level's
    GROUPS * UNROLL points; steps past the last load nothing."""
    STEPS: tl.constexpr = (NUM_POINTS + GROUPS * UNROLL - 1) // (GROUPS * UNROLL)  # a level's steps
    level = step // STEPS
    point = (step % STEPS) * (GROUPS * UNROLL) + group  # [GROUPS, 1]
    mask = (point < NUM_POINTS) & q_ok & (step < NUM_LEVELS * STEPS)
    param = first_param + level * NUM_POINTS + point  # [GROUPS, BLOCK_Q]
    # Masked logits are -inf: weight exactly 0.
    attn_a = tl.load(attn_ptr + param, mask=mask, other=float("-inf") if SOFTMAX else 0.0)
    # x and y interleave: one 8-byte load for both.
    pair = tl.arange(0, 2)[None, None, :]
    xy_a = tl.load(loc_ptr + 2 * param[:, :, None] + pair, mask=mask[:, :, None], other=0.0)
    if UNROLL == 2:
        mask = (point + GROUPS < NUM_POINTS) & q_ok & (step < NUM_LEVELS * STEPS)
        attn_b = tl.load(attn_ptr + param + GROUPS, mask=mask, other=float("-inf") if SOFTMAX else 0.0)
        xy_b = tl.load(loc_ptr + 2 * (param + GROUPS)[:, :, None] + pair, mask=mask[:, :, None], other=0.0)
    else:
        tl.static_assert(UNROLL == 1, "the forward unrolls at most 2 points a step (launch.MAX_UNROLL)")
        attn_b, xy_b = attn_a, xy_a
    return attn_a, xy_a, attn_b, xy_b


@triton.jit
def _own_sample_params(loc_ptr, attn_ptr, param, ok):
    """The weight and (x, y) of each thread's own sample at `param` (0 where not `ok`), as
    loaded: no arithmetic on them here, so that loads issued a round ahead are not waited on
    where they are issued."""
    attn = tl.load(attn_ptr + weight_offsets(param, ok), mask=ok, other=0.0)
    x = tl.load(loc_ptr + 2 * param, mask=ok, other=0.0)
    y = tl.load(loc_ptr + 2 * param + 1, mask=ok, other=0.0)
    return attn, x, y


@triton.jit
def _bf16_pairs(pairs, mask):
    """The bfloat16 value rows at `pairs` (int32 pointers, two elements each; zeros where not
    `mask`) as float32: the pairs' low elements and their high ones, two tensors of its shape.

    A bfloat16's float32 is its 16 bits shifted up, so the low element of a pair is pair << 16
    and the high one pair & 0xFFFF0000, one integer op each; the conversion Triton emits for
    bfloat16 takes about 1.5 (bench/NOTES.md, entry 25). Joined on a last axis of 2, or merged
    into one channel axis, the halves took another layout, and Triton recomputed the sample
    weights in it: hence two tensors (and two accumulators)."""
    bits = tl.load(pairs, mask=mask, other=0)
    return (bits << 16).to(tl.float32, bitcast=True), (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _add_sample(
    acc,
    acc_high,
    row_max,
    row_sum,
    attn,
    xy,
    point,
    q_ok,
    h,
    w,
    usable,
    level_row,
    value_ptr,
    lanes,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    COMPUTE: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
):
    """Add one point of each (group, query) to `acc`: its four corners' value rows, weighed
    (with BF16_PAIRS: the pairs' low elements to `acc`, their high ones to `acc_high`).
    With SOFTMAX, `attn` holds logits: an online softmax per thread group, row_max and row_sum
    ([GROUPS, BLOCK_Q]) the largest logit the group has seen and its sum of exp(logit - row_max),
    acc rescaled whenever the largest grows (the kernel combines the groups at the end)."""
    mask = (point < NUM_POINTS) & q_ok
    attn = attn.to(COMPUTE)
    if SOFTMAX:
        new_max = tl.maximum(row_max, attn)
        # Nothing but -inf seen yet: rescale by 1 and weigh 0 (not -inf - -inf = NaN). A
        # +inf or NaN logit makes its weight NaN, and so the query's output (torch.softmax).
        seen = new_max != float("-inf")
        rescale = tl.where(seen, tl.exp(row_max - new_max), 1.0)
        attn = tl.where(seen, tl.exp(attn - new_max), 0.0)
        acc = acc * rescale[:, :, None, None]
        if BF16_PAIRS:
            acc_high = acc_high * rescale[:, :, None, None]
        row_sum = row_sum * rescale + attn
        row_max = new_max
    else:  # a softmax weight, exp(logit - running max), is finite or NaN already
        attn = finite_or_nan(attn)
    x, y = tl.split(xy)
    x0, y0, fx, fy, left, right, top, bottom = place_sample(x, y, h, w, usable, mask, COMPUTE)
    attn_top = attn * (1.0 - fy)
    attn_bottom = attn * fy
    if BF16_PAIRS:
        # Pointers to the top-left corner's pairs (`lanes` across the row); the other corners
        # are a pixel (NUM_HEADS rows) and an image row (w pixels) away, constant offsets from a
        # pointer that fold into the load instructions. Where a corner is outside, its pointers
        # are unused: every access through them is masked.
        PIXEL: tl.constexpr = NUM_HEADS * (HEAD_DIM // 2)
        upper = value_ptr.to(tl.pointer_type(tl.int32)) + (
            (level_row + (y0 * w + x0) * NUM_HEADS) * (HEAD_DIM // 2)
        )[:, :, None, None] + lanes
        lower = upper + w * PIXEL  # the bottom corners' rows
        lane_ok = lanes < HEAD_DIM // 2
        low, high = _bf16_pairs(upper, (left & top)[:, :, None, None] & lane_ok)
        acc += (attn_top * (1.0 - fx))[:, :, None, None] * low
        acc_high += (attn_top * (1.0 - fx))[:, :, None, None] * high
        low, high = _bf16_pairs(upper + PIXEL, (right & top)[:, :, None, None] & lane_ok)
        acc += (attn_top * fx)[:, :, None, None] * low
        acc_high += (attn_top * fx)[:, :, None, None] * high
        low, high = _bf16_pairs(lower, (left & bottom)[:, :, None, None] & lane_ok)
        acc += (attn_bottom * (1.0 - fx))[:, :, None, None] * low
        acc_high += (attn_bottom * (1.0 - fx))[:, :, None, None] * high
        low, high = _bf16_pairs(lower + PIXEL, (right & bottom)[:, :, None, None] & lane_ok)
        acc += (attn_bottom * fx)[:, :, None, None] * low
        acc_high += (attn_bottom * fx)[:, :, None, None] * high
    else:
        # Element offset of the top-left corner's row (`lanes` across it); the others are ROW
        # and w * ROW away. Where a corner is outside, its offset is unused: every access through
        # it is masked.
        ROW: tl.constexpr = NUM_HEADS * HEAD_DIM  # elements between horizontally adjacent pixels
        d_ok = lanes < HEAD_DIM
        corner = (level_row + (y0 * w + x0) * NUM_HEADS) * HEAD_DIM
        corner = corner[:, :, None, None] + lanes
        below = corner + w * ROW
        v = tl.load(value_ptr + corner, mask=(left & top)[:, :, None, None] & d_ok, other=0.0)
        acc += (attn_top * (1.0 - fx))[:, :, None, None] * v.to(COMPUTE)
        v = tl.load(value_ptr + corner + ROW, mask=(right & top)[:, :, None, None] & d_ok, other=0.0)
        acc += (attn_top * fx)[:, :, None, None] * v.to(COMPUTE)
        v = tl.load(value_ptr + below, mask=(left & bottom)[:, :, None, None] & d_ok, other=0.0)
        acc += (attn_bottom * (1.0 - fx))[:, :, None, None] * v.to(COMPUTE)
        v = tl.load(value_ptr + below + ROW, mask=(right & bottom)[:, :, None, None] & d_ok, other=0.0)
        acc += (attn_bottom * fx)[:, :, None, None] * v.to(COMPUTE)
    return acc, acc_high, row_max, row_sum


@triton.jit
def _step(
    step,
    acc,
    acc_high,
    start,
    row_max,
    row_sum,
    next_attn_a,
    next_xy_a,
    next_attn_b,
    next_xy_b,
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
    lanes,
    num_values,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    COMPUTE: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,
    SOFTMAX: tl.constexpr,
    PREFETCH: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
):
    """One loop step: GROUPS * UNROLL points of one level for each query. With PREFETCH the
    step's parameters were loaded by the step before (the next_* arguments) and this step loads
    the next one's, so that their latency overlaps this step's gathers instead of preceding them;
    returns the running values and the parameters for the next step."""
    if PREFETCH:
        attn_a, xy_a, attn_b, xy_b = next_attn_a, next_xy_a, next_attn_b, next_xy_b
        next_attn_a, next_xy_a, next_attn_b, next_xy_b = _step_params(
            step + 1, loc_ptr, attn_ptr, first_param, q_ok, group, NUM_LEVELS, NUM_POINTS, GROUPS, UNROLL, SOFTMAX
        )
    else:
        attn_a, xy_a, attn_b, xy_b = _step_params(
            step, loc_ptr, attn_ptr, first_param, q_ok, group, NUM_LEVELS, NUM_POINTS, GROUPS, UNROLL, SOFTMAX
        )
    STEPS: tl.constexpr = (NUM_POINTS + GROUPS * UNROLL - 1) // (GROUPS * UNROLL)  # a level's steps
    level = step // STEPS
    h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
    w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
    if LEVEL_STARTS:
        start = tl.load(starts_ptr + level).to(b.dtype)
    usable = level_ok(h, w, start, num_values)
    level_row = (b * num_values + start) * NUM_HEADS + m
    point = (step % STEPS) * (GROUPS * UNROLL) + group  # [GROUPS, 1]
    acc, acc_high, row_max, row_sum = _add_sample(
        acc, acc_high, row_max, row_sum, attn_a, xy_a, point, q_ok, h, w, usable, level_row, value_ptr, lanes,
        NUM_HEADS, HEAD_DIM, NUM_POINTS, COMPUTE, SOFTMAX, BF16_PAIRS,
    )  # fmt: skip
    if UNROLL == 2:
        acc, acc_high, row_max, row_sum = _add_sample(
            acc, acc_high, row_max, row_sum, attn_b, xy_b, point + GROUPS, q_ok, h, w, usable, level_row, value_ptr,
            lanes, NUM_HEADS, HEAD_DIM, NUM_POINTS, COMPUTE, SOFTMAX, BF16_PAIRS,
        )  # fmt: skip
    if not LEVEL_STARTS:  # the next level's first row, after the level's last step
        start = tl.where(step % STEPS == STEPS - 1, start + h * w, start)
    return acc, acc_high, start, row_max, row_sum, next_attn_a, next_xy_a, next_attn_b, next_xy_b


@triton.jit
def _lane_placed_samples(
    value_ptr,
    shapes_ptr,
    starts_ptr,
    loc_ptr,
    attn_ptr,
    b,
    m,
    q,
    num_queries,
    num_values,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    GROUPS: tl.constexpr,
    LANES: tl.constexpr,
    VECTOR: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,
    LANE_AXIS: tl.constexpr,
    SHUFFLE: tl.constexpr,
    LANE_UNROLL: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
    PARAMS_AHEAD: tl.constexpr,
):
    """The weighed sum of every sample of each (group, query) in the tile of `sampling.lane_tile`
    (lane, group and query along their axes, channel lane * VECTOR + element along the last),
    and a placeholder; with BF16_PAIRS the sums of the pairs' low and high elements, VECTOR // 2
    along the last axis each (channel lane * VECTOR + 2 * pair + 0 or 1: see `_bf16_pairs`).
    Each sample is placed once: the LANES threads that read a value row each place one sample of
    their row's query, then take turns, every thread of the row reading the corners of lane k's
    sample with its placement passed by `sampling.from_lane`. The other loop places every sample
    in each of the row's threads: most of its instructions (bench/NOTES.md, entry 26). The lane
    axis is the one the release lays over consecutive lanes of a warp (`launch.LANE_AXIS`).
    PARAMS_AHEAD: each round's sample parameters are loaded during the round before (a
    program's first round still waits for its own), so that a program of several rounds waits
    for them once."""
    SAMPLES: tl.constexpr = NUM_LEVELS * NUM_POINTS
    ROUNDS: tl.constexpr = (SAMPLES + GROUPS * LANES - 1) // (GROUPS * LANES)
    # Turns a round: fewer than LANES where a group has fewer samples than its row has threads
    # (4 groups of 4 samples at float32's 8 lanes), so no turn reads only masked corners.
    TURNS: tl.constexpr = min(LANES, (SAMPLES + GROUPS - 1) // GROUPS)
    lane, group, q = lane_tile(q, LANES, GROUPS, LANE_AXIS)
    TILE: tl.constexpr = (lane + group + q).shape  # the tile's axes in lane_tile's order, the last 1
    first_param = ((b * num_queries + q) * NUM_HEADS + m) * SAMPLES  # one a query
    if BF16_PAIRS:  # offsets in int32 pairs of elements
        ELEMENTS: tl.constexpr = 2
        pairs_ptr = value_ptr.to(tl.pointer_type(tl.int32))
        acc_high = tl.zeros([TILE[0], TILE[1], TILE[2], VECTOR // 2], dtype=tl.float32)
    else:
        ELEMENTS: tl.constexpr = 1
        acc_high = tl.zeros([1], dtype=tl.float32)  # unused
    channel = lane * (VECTOR // ELEMENTS) + tl.arange(0, VECTOR // ELEMENTS)[None, None, None, :]
    d_ok = channel < HEAD_DIM // ELEMENTS
    ROW: tl.constexpr = NUM_HEADS * HEAD_DIM // ELEMENTS  # between horizontally adjacent pixels
    PACK_CORNERS: tl.constexpr = (HEAD_DIM // ELEMENTS) % 16 == 0
    # Where the groups divide a level's points, lane k's sample in turn k of round r is of level
    # (k + LANES * r) // (NUM_POINTS // GROUPS) in every group: the same for each thread.
    LEVEL_OF_TURN: tl.constexpr = PACK_CORNERS and NUM_POINTS % GROUPS == 0
    acc = tl.zeros([TILE[0], TILE[1], TILE[2], VECTOR // ELEMENTS], dtype=tl.float32)
    if PARAMS_AHEAD:
        first = group + GROUPS * lane
        next_attn, next_x, next_y = _own_sample_params(
            loc_ptr, attn_ptr, first_param + first, (first < SAMPLES) & (q < num_queries)
        )
    else:  # placeholders, unused
        next_attn, next_x, next_y = attn_ptr, loc_ptr, loc_ptr
    for r in tl.range(0, ROUNDS):
        # Lane j of group g places sample g + GROUPS * (j + LANES * r): strided across the lanes,
        # so that each thread loads its own parameters rather than a vector of its neighbours'.
        sample = group + GROUPS * (lane + LANES * r)  # one a (lane, group)
        ok = (sample < SAMPLES) & (q < num_queries)
        level = tl.where(sample < SAMPLES, sample // NUM_POINTS, 0)
        h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
        w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
        if LEVEL_STARTS:
            start = tl.load(starts_ptr + level).to(b.dtype)
        else:  # the sizes of the levels before
            start = level * 0
            for before in tl.static_range(NUM_LEVELS - 1):
                size = tl.load(shapes_ptr + 2 * before).to(b.dtype) * tl.load(shapes_ptr + 2 * before + 1).to(b.dtype)
                start += tl.where(before < level, size, 0)
        if PARAMS_AHEAD:  # this round's, loaded during the last one; then the next round's
            attn, x, y = next_attn, next_x, next_y
            attn = finite_or_nan(attn.to(tl.float32))
            ahead = sample + GROUPS * LANES
            next_attn, next_x, next_y = _own_sample_params(
                loc_ptr, attn_ptr, first_param + ahead, (ahead < SAMPLES) & (q < num_queries)
            )
        else:  # (inline, not `_own_sample_params`: so these configs compile as they did, entry 69)
            param = first_param + sample
            attn = finite_or_nan(tl.load(attn_ptr + weight_offsets(param, ok), mask=ok, other=0.0).to(tl.float32))
            x = tl.load(loc_ptr + 2 * param, mask=ok, other=0.0)
            y = tl.load(loc_ptr + 2 * param + 1, mask=ok, other=0.0)
        # Offsets in elements, or pairs (int32: the lane placement has 32-bit indices only).
        row, below, corners, fx, fy = placed_corner_rows(
            x, y, h, w, start, b, m, num_values, ok, NUM_HEADS, HEAD_DIM // ELEMENTS, PACK_CORNERS
        )
        attn_top = attn * (1.0 - fy)
        attn_bottom = attn * fy
        # A loop, LANE_UNROLL sub-steps a turn: fully unrolled, the first call took over 5 s
        # (bench/NOTES.md entry 26); as a loop it runs as fast (entry 27). A turn passes five
        # numbers where the corners are packed, four where its level is known too: shuffles cost
        # L1 wavefronts as loads do, so the corners' weights are remade from attn_top,
        # attn_bottom and fx (entry 30), and the levels' widths sit in uniform registers.
        for k in tl.range(0, TURNS, loop_unroll_factor=LANE_UNROLL):
            if PACK_CORNERS:
                inside = from_lane(row, k, LANE_AXIS, SHUFFLE)
                # Multiples of 16, said so (`& -16` holds the hint: on a shuffle's result Triton
                # drops it), or Triton would not vectorize the loads.
                top_row = tl.multiple_of(inside & -16, [16, 16, 16, 16]) + channel
                if LEVEL_OF_TURN:  # every lane k of a turn samples one level: its width, not a shuffle
                    level_k = (k + LANES * r) // (NUM_POINTS // GROUPS)
                    width = tl.load(shapes_ptr + 1).to(b.dtype)
                    for other in tl.static_range(1, NUM_LEVELS):
                        width = tl.where(level_k == other, tl.load(shapes_ptr + 2 * other + 1).to(b.dtype), width)
                    bottom_row = top_row + width * ROW
                else:
                    bottom_row = from_lane(below, k, LANE_AXIS, SHUFFLE)
                    bottom_row = tl.multiple_of(bottom_row & -16, [16, 16, 16, 16]) + channel
            else:
                top_row = from_lane(row, k, LANE_AXIS, SHUFFLE) * (HEAD_DIM // ELEMENTS) + channel
                bottom_row = from_lane(below, k, LANE_AXIS, SHUFFLE) * (HEAD_DIM // ELEMENTS) + channel
                inside = from_lane(corners, k, LANE_AXIS, SHUFFLE)
            a_top = from_lane(attn_top, k, LANE_AXIS, SHUFFLE)
            a_bottom = from_lane(attn_bottom, k, LANE_AXIS, SHUFFLE)
            fx_k = from_lane(fx, k, LANE_AXIS, SHUFFLE)
            w_tl = a_top * (1.0 - fx_k)
            w_tr = a_top * fx_k
            w_bl = a_bottom * (1.0 - fx_k)
            w_br = a_bottom * fx_k
            if BF16_PAIRS:  # one integer op an element to float32 (`_bf16_pairs`), as float16's conversion
                low, high = _bf16_pairs(pairs_ptr + top_row, ((inside & 1) != 0) & d_ok)
                acc += w_tl * low
                acc_high += w_tl * high
                low, high = _bf16_pairs(pairs_ptr + top_row + ROW, ((inside & 2) != 0) & d_ok)
                acc += w_tr * low
                acc_high += w_tr * high
                low, high = _bf16_pairs(pairs_ptr + bottom_row, ((inside & 4) != 0) & d_ok)
                acc += w_bl * low
                acc_high += w_bl * high
                low, high = _bf16_pairs(pairs_ptr + bottom_row + ROW, ((inside & 8) != 0) & d_ok)
                acc += w_br * low
                acc_high += w_br * high
            else:
                v = tl.load(value_ptr + top_row, mask=((inside & 1) != 0) & d_ok, other=0.0)
                acc += w_tl * v.to(tl.float32)
                v = tl.load(value_ptr + top_row + ROW, mask=((inside & 2) != 0) & d_ok, other=0.0)
                acc += w_tr * v.to(tl.float32)
                v = tl.load(value_ptr + bottom_row, mask=((inside & 4) != 0) & d_ok, other=0.0)
                acc += w_bl * v.to(tl.float32)
                v = tl.load(value_ptr + bottom_row + ROW, mask=((inside & 8) != 0) & d_ok, other=0.0)
                acc += w_br * v.to(tl.float32)
    return acc, acc_high


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
    PREFETCH: tl.constexpr,  # load each step's parameters one step ahead
    BF16_PAIRS: tl.constexpr,  # bfloat16 value read as int32 pairs (even HEAD_DIM): see _bf16_pairs
    LANE_PLACEMENT: tl.constexpr,  # each sample placed by one thread of its row: _lane_placed_samples
    LANE_AXIS: tl.constexpr,  # with LANE_PLACEMENT: the tile's lane axis, 0 or 2 (sampling.lane_tile)
    SHUFFLE: tl.constexpr,  # with LANE_PLACEMENT: placements passed by PTX shuffles, not gathers (sampling.from_lane)
    LANE_UNROLL: tl.constexpr,  # with LANE_PLACEMENT: the row's turns unrolled this many at a time
    PARAMS_AHEAD: tl.constexpr,  # with LANE_PLACEMENT: each round's sample parameters loaded a round ahead
):
    # One program: BLOCK_Q queries of one (batch, head); neighbouring programs take the next
    # queries of the same head, so the programs resident at one time work on few heads and
    # every SM's L1 holds those heads' rows (bench/NOTES.md entry 32: spread over all heads, the
    # encoder lost up to 35%). The flat 1-D grid has no 65535 limit on B * M.
    pid = tl.program_id(0)
    if INDEX_64:  # every index below derives from pid: 64-bit where a tensor passes 2**31 elements
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    bm = pid // num_q_blocks
    b = bm // NUM_HEADS
    m = bm % NUM_HEADS
    q = (pid % num_q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out_row = (b * num_queries + q) * NUM_HEADS + m
    if LANE_PLACEMENT:
        tl.static_assert(CHUNK == BLOCK_D, "LANE_PLACEMENT reads a row with one load a thread")
        VECTOR: tl.constexpr = 128 // value_ptr.dtype.element_ty.primitive_bitwidth  # elements in 16 bytes
        LANES: tl.constexpr = CHUNK // VECTOR
        acc, acc_high = _lane_placed_samples(
            value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, b, m, q, num_queries, num_values, NUM_HEADS,
            HEAD_DIM, NUM_LEVELS, NUM_POINTS, GROUPS, LANES, VECTOR, LEVEL_STARTS, LANE_AXIS, SHUFFLE, LANE_UNROLL,
            BF16_PAIRS, PARAMS_AHEAD,
        )  # fmt: skip
        # The groups summed, the tile's other axes kept: each thread stores its own vector.
        GROUP_AXIS: tl.constexpr = 1 if LANE_AXIS == 0 else 0
        out = tl.sum(acc, axis=GROUP_AXIS, keep_dims=True)  # or the pairs' low elements
        if BF16_PAIRS:  # the pairs interleaved again
            high = tl.sum(acc_high, axis=GROUP_AXIS, keep_dims=True)
            out = tl.reshape(tl.join(out, high), [out.shape[0], out.shape[1], out.shape[2], VECTOR])
        lane, _, query = lane_tile(q, LANES, 1, LANE_AXIS)
        out_channel = lane * VECTOR + tl.arange(0, VECTOR)[None, None, None, :]
        tl.store(
            out_ptr + ((b * num_queries + query) * NUM_HEADS + m) * HEAD_DIM + out_channel,
            out.to(out_ptr.dtype.element_ty),
            mask=(query < num_queries) & (out_channel < HEAD_DIM),
        )
    else:
        q_ok = (q < num_queries)[None, :]
        group = tl.arange(0, GROUPS)[:, None]

        # The gathered tile is [GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK]. Triton gives threads to the
        # contiguous last axis (16 bytes each), then to the groups and queries, and leaves the chunk
        # axis to each thread's registers: a row is read by CHUNK / vector threads, each holding
        # BLOCK_D / CHUNK vectors of it.
        # BF16_PAIRS reads the same rows as int32 pairs: CHUNK // 2 lanes a chunk (_gather_rows).
        LANES: tl.constexpr = CHUNK // 2 if BF16_PAIRS else CHUNK
        lanes = tl.arange(0, BLOCK_D // CHUNK)[:, None] * LANES + tl.arange(0, LANES)[None, :]
        lanes = lanes[None, None, :, :]
        first_param = ((b * num_queries + q[None, :]) * NUM_HEADS + m) * (NUM_LEVELS * NUM_POINTS)  # [1, BLOCK_Q]

        # With SOFTMAX: each thread group's running max and sum of the logits it has weighed (an
        # online softmax, one pass over the logits). The statistics of a separate first pass came out
        # of their reduction in a layout Triton then converted the loop's tensors to and back through
        # shared memory on every step (bench/NOTES.md entry 18); these stay in the loop's layout.
        row_max = tl.full([GROUPS, BLOCK_Q], float("-inf"), COMPUTE)
        row_sum = tl.zeros([GROUPS, BLOCK_Q], dtype=COMPUTE)

        if BF16_PAIRS:  # the pairs' low and high elements (_gather_rows)
            acc = tl.zeros([GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK // 2], dtype=COMPUTE)
            acc_high = tl.zeros([GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK // 2], dtype=COMPUTE)
        else:
            acc = tl.zeros([GROUPS, BLOCK_Q, BLOCK_D // CHUNK, CHUNK], dtype=COMPUTE)
            acc_high = tl.zeros([1], dtype=COMPUTE)  # unused
        start = b * 0  # the level's first row, in the index dtype
        # The first step's parameters (PREFETCH), else placeholders the steps pass along unread.
        if PREFETCH:
            attn_a, xy_a, attn_b, xy_b = _step_params(
                0, loc_ptr, attn_ptr, first_param, q_ok, group, NUM_LEVELS, NUM_POINTS, GROUPS, UNROLL, SOFTMAX
            )
        else:
            attn_a = tl.zeros([GROUPS, BLOCK_Q], dtype=attn_ptr.dtype.element_ty)
            xy_a = tl.zeros([GROUPS, BLOCK_Q, 2], dtype=loc_ptr.dtype.element_ty)
            attn_b, xy_b = attn_a, xy_a
        # One loop over every level's steps, unrolled only where there are few samples in all:
        # compile time grows with the unrolled samples.
        TOTAL_STEPS: tl.constexpr = NUM_LEVELS * ((NUM_POINTS + GROUPS * UNROLL - 1) // (GROUPS * UNROLL))
        if LEVELS_UNROLLED:
            for step in tl.static_range(TOTAL_STEPS):
                acc, acc_high, start, row_max, row_sum, attn_a, xy_a, attn_b, xy_b = _step(
                    step, acc, acc_high, start, row_max, row_sum, attn_a, xy_a, attn_b, xy_b, value_ptr, shapes_ptr,
                    starts_ptr, loc_ptr, attn_ptr, b, m, first_param, q_ok, group, lanes, num_values, NUM_HEADS,
                    HEAD_DIM, NUM_LEVELS, NUM_POINTS, GROUPS, UNROLL, COMPUTE, LEVEL_STARTS, SOFTMAX, PREFETCH,
                    BF16_PAIRS,
                )  # fmt: skip
        else:
            for step in tl.range(0, TOTAL_STEPS):
                acc, acc_high, start, row_max, row_sum, attn_a, xy_a, attn_b, xy_b = _step(
                    step, acc, acc_high, start, row_max, row_sum, attn_a, xy_a, attn_b, xy_b, value_ptr, shapes_ptr,
                    starts_ptr, loc_ptr, attn_ptr, b, m, first_param, q_ok, group, lanes, num_values, NUM_HEADS,
                    HEAD_DIM, NUM_LEVELS, NUM_POINTS, GROUPS, UNROLL, COMPUTE, LEVEL_STARTS, SOFTMAX, PREFETCH,
                    BF16_PAIRS,
                )  # fmt: skip

        if SOFTMAX:  # the groups' sums brought to the query's largest logit, then normalized
            largest = tl.max(row_max, axis=0, keep_dims=True)  # [1, BLOCK_Q]
            # A group that saw only -inf adds 0 (no -inf - -inf); all -inf: 0 / 0 = NaN, as torch.softmax.
            group_scale = tl.where(row_max == float("-inf"), 0.0, tl.exp(row_max - largest))
            acc = acc * group_scale[:, :, None, None]
            if BF16_PAIRS:
                acc_high = acc_high * group_scale[:, :, None, None]
            total = tl.sum(row_sum * group_scale, axis=0)  # [BLOCK_Q]
        out = tl.sum(acc, axis=0)  # [BLOCK_Q, BLOCK_D // CHUNK, CHUNK]
        if BF16_PAIRS:  # the pairs interleaved again
            out = tl.reshape(tl.join(out, tl.sum(acc_high, axis=0)), [BLOCK_Q, BLOCK_D // CHUNK, CHUNK])
        if SOFTMAX:
            out = out / total[:, None, None]
        out_channel = tl.arange(0, BLOCK_D // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        tl.store(
            out_ptr + out_row[:, None, None] * HEAD_DIM + out_channel[None, :, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(q < num_queries)[:, None, None] & (out_channel < HEAD_DIM)[None, :, :],
        )
