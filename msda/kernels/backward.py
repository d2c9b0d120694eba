"""The MSDA backward kernel (all three gradients in one pass), the kernel that folds the
replicas of dense levels back into grad_value, and the rules that pick the dtype grad_value is
accumulated in and the replicas' size."""

import torch
import triton
import triton.language as tl

from .deterministic import rank_as_float
from .sampling import (
    finite_or_nan,
    from_lane,
    lane_tile,
    level_ok,
    place_sample,
    placed_corner_rows,
    softmax_stats,
    weight_offsets,
)


# Sizes and strides vary with the image: not specialized (see forward.py).
@triton.jit(
    do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "num_values", "replica_rows"]
)
def msda_backward_kernel(
    grad_out_ptr,  # (B, Q, M * D), channels contiguous, any other strides (an expanded one has 0)
    grad_out_stride_b,
    grad_out_stride_q,
    value_ptr,  # (B, S, M, D), contiguous
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous: the weights, or with SOFTMAX the logits
    grad_value_ptr,  # (B, S, M, D) zeros: value's dtype, the float32 accumulator, or int64 (FIXED_POINT)
    replica_ptr,  # with REPLICAS: (B, replica_rows, M, D) zeros like grad_value (`level_replicas`); else unused
    fixed_point_scale_ptr,  # with FIXED_POINT: the float32 scale of grad_value's integers; else unused
    grad_loc_ptr,  # like loc
    grad_attn_ptr,  # like attn
    scratch_ptr,  # with SOFTMAX: (B, Q, M, L, K) in COMPUTE, may be grad_attn itself; else unused
    counts_ptr,  # int32 zeros: COUNT_STRIDE: the deterministic lists' counters; FOLD_PIXELS: (B, M); else unused
    list_ranks_ptr,  # with COUNT_STRIDE: the lists' weights' array (float): each sample's rank goes there; else unused
    num_queries,
    num_values,
    replica_rows,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,  # points per group unrolled in one loop step
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE: tl.constexpr,
    INDEX_64: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,  # False: level_start_index was not given, sum the level sizes
    SOFTMAX: tl.constexpr,  # attn_ptr holds logits: weights are their softmax, grad_attn is d/d logits
    FIXED_POINT: tl.constexpr,  # grad_value sums integers (deterministic mode): see fixed_point_scale
    PREFETCH: tl.constexpr,  # load each step's parameters one step ahead (UNROLL 1)
    REPLICAS: tl.constexpr,  # spread the adds of dense levels over replicas of their rows
    LAST_BATCH_FIRST: tl.constexpr,  # programs take the batches in reverse order
    GRAD_VALUE: tl.constexpr,  # False: no grad_value (the deterministic mode's lists sum it: deterministic.py)
    VALUE_EVICTION: tl.constexpr,  # the value gathers' eviction hint, L1 and L2 alike ("" or "evict_first")
    COUNT_STRIDE: tl.constexpr,  # > 0: count each sample into its list, counters this many int32 apart
    TILE_PIXELS: tl.constexpr,  # > 0: the last level's adds are shared_tile.py's where it has at most this many pixels
    LANE_PLACEMENT: tl.constexpr,  # each sample placed by one thread of its row (launch.backward_lane_placement)
    LANE_AXIS: tl.constexpr,  # with LANE_PLACEMENT: the tile's lane axis, 0 or 2 (sampling.lane_tile)
    SHUFFLE: tl.constexpr,  # with LANE_PLACEMENT: placements passed by PTX shuffles, not gathers (sampling.from_lane)
    LANE_UNROLL: tl.constexpr,  # with LANE_PLACEMENT: turns a loop step (1 or 2)
    FOLD_PIXELS: tl.constexpr,  # > 0 (with REPLICAS): the replicas folded here, this many pixels a step (see the end)
    FOLD_UNROLL: tl.constexpr,  # with FOLD_PIXELS: replicas' loads issued together
):
    # The forward's program layout and tile (msda/kernels/forward.py explains both).
    pid = tl.program_id(0)
    if INDEX_64:  # every index below derives from pid: 64-bit where a tensor passes 2**31 elements
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    q_block = pid % num_q_blocks
    bm = pid // num_q_blocks
    if LAST_BATCH_FIRST:
        # grad_value was zeroed in address order just before this kernel, so the L2 still holds
        # the last batches' zeroed rows (a float32 grad_value of 91 MB does not fit in it whole):
        # their adds come first, before eviction claims them.
        bm = tl.num_programs(0) // num_q_blocks - 1 - bm
    b = bm // NUM_HEADS
    m = bm % NUM_HEADS
    q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if LANE_PLACEMENT:
        # Each sample placed once, by one thread of its row, as the forward's lane placement does
        # (forward._lane_placed_samples): the LANES threads that read a value row each place one
        # sample of their row's query, then take turns, the row's threads gathering and adding
        # into the corners of lane k's sample with its placement passed by `from_lane`. Lane k
        # keeps its sample's four corner dots, and after the turns each thread works out and
        # stores its own sample's gradients: the step loop below places, loads the parameters
        # of and stores the gradients of every sample in each of its row's threads.
        # The tile is the forward's (sampling.lane_tile: its lane axis over consecutive lanes of
        # a warp, scripts/compile_check.py checks it).
        tl.static_assert(CHUNK == BLOCK_D, "LANE_PLACEMENT reads a row with one load a thread")
        tl.static_assert(LANE_UNROLL == 1 or LANE_UNROLL == 2, "the backward takes one or two turns a step")
        VECTOR: tl.constexpr = 128 // value_ptr.dtype.element_ty.primitive_bitwidth  # elements in 16 bytes
        LANES: tl.constexpr = CHUNK // VECTOR
        SAMPLES: tl.constexpr = NUM_LEVELS * NUM_POINTS
        ROUNDS: tl.constexpr = (SAMPLES + GROUPS * LANES - 1) // (GROUPS * LANES)
        TURNS: tl.constexpr = min(LANES, (SAMPLES + GROUPS - 1) // GROUPS)  # as in the forward
        ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
        PACK_CORNERS: tl.constexpr = HEAD_DIM % 16 == 0  # the corners ride in the row offset's low bits
        ACCUMULATOR = grad_value_ptr.dtype.element_ty
        lane, group, query = lane_tile(q, LANES, GROUPS, LANE_AXIS)
        channel = lane * VECTOR + tl.arange(0, VECTOR)[None, None, None, :]
        d_ok = channel < HEAD_DIM
        grad_out = tl.load(
            grad_out_ptr + b * grad_out_stride_b + query * grad_out_stride_q + m * HEAD_DIM + channel,
            mask=(query < num_queries) & d_ok,
            other=0.0,
        ).to(tl.float32)  # one a (lane, query)
        first_param = ((b * num_queries + query) * NUM_HEADS + m) * SAMPLES  # one a query
        # Programs start at another level and wrap round, as in the step loop (it says why).
        first_level = q_block % NUM_LEVELS
        if REPLICAS:
            # Per level (tuples of NUM_LEVELS): the offset from an element of its grad_value rows
            # to the same element of this program's replica of them, and whether the program has
            # one (replica 0 is grad_value itself), as the step loop picks it. (Inline: a helper
            # given shapes_ptr makes torch.compile believe it is written, bench/NOTES.md entry 38.)
            shifts = ()
            redirected = ()
            used = b * 0  # replica rows (a batch) taken by the levels before
            level_start = b * 0  # (names of their own: the round loop below carries h, w and start)
            for each in tl.static_range(NUM_LEVELS):
                level_h = tl.load(shapes_ptr + 2 * each).to(b.dtype)
                level_w = tl.load(shapes_ptr + 2 * each + 1).to(b.dtype)
                if LEVEL_STARTS:
                    level_start = tl.load(starts_ptr + each).to(b.dtype)
                replicas, area = level_replicas(level_h, level_w, used, num_queries, replica_rows, NUM_POINTS)
                replica = q_block % replicas
                level_row = (b * num_values + level_start) * NUM_HEADS + m
                replica_row = (b * replica_rows + used + (replica - 1) * area) * NUM_HEADS + m
                shifts = shifts + ((replica_row - level_row) * HEAD_DIM,)
                redirected = redirected + (replica > 0,)
                used += (replicas - 1) * area
                if not LEVEL_STARTS:
                    level_start += level_h * level_w
        for r in tl.range(0, ROUNDS):
            sample = group + GROUPS * (lane + LANES * r)  # one a (lane, group)
            ok = (sample < SAMPLES) & (query < num_queries)
            level = (tl.where(sample < SAMPLES, sample // NUM_POINTS, 0) + first_level) % NUM_LEVELS
            h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
            w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
            if LEVEL_STARTS:
                start = tl.load(starts_ptr + level).to(b.dtype)
            else:  # the sizes of the levels before
                start = level * 0
                for before in tl.static_range(NUM_LEVELS - 1):
                    size = tl.load(shapes_ptr + 2 * before).to(b.dtype)
                    size *= tl.load(shapes_ptr + 2 * before + 1).to(b.dtype)
                    start += tl.where(before < level, size, 0)
            param = first_param + level * NUM_POINTS + sample % NUM_POINTS
            weight = weight_offsets(param, ok)
            attn = finite_or_nan(tl.load(attn_ptr + weight, mask=ok, other=0.0).to(tl.float32))
            x = tl.load(loc_ptr + 2 * param, mask=ok, other=0.0)
            y = tl.load(loc_ptr + 2 * param + 1, mask=ok, other=0.0)
            row, below, corners, fx, fy = placed_corner_rows(
                x, y, h, w, start, b, m, num_values, ok, NUM_HEADS, HEAD_DIM, PACK_CORNERS
            )
            a_top = attn * (1.0 - fy)
            a_bottom = attn * fy
            # This thread's sample's corner rows dotted with grad_out, from the turn that was its own.
            dot_tl = tl.zeros_like(fx)
            dot_tr = tl.zeros_like(fx)
            dot_bl = tl.zeros_like(fx)
            dot_br = tl.zeros_like(fx)
            # LANE_UNROLL 2 takes two turns a step, the rows of both loaded before either's adds
            # (the step loop says why the loads come first).
            for k in tl.range(0, TURNS, LANE_UNROLL):
                top_row, bottom_row, inside, w_tl, w_tr, w_bl, w_br = _lane_turn(
                    row, below, corners, a_top, a_bottom, fx, k, channel, True, HEAD_DIM, PACK_CORNERS, LANE_AXIS,
                    SHUFFLE,
                )  # fmt: skip
                accumulator = grad_value_ptr  # where turn k's adds go: grad_value, or its level's replica
                if REPLICAS:
                    accumulator = _turn_accumulator(
                        grad_value_ptr, replica_ptr, shifts, redirected, group + GROUPS * (k + LANES * r), first_level,
                        NUM_LEVELS, NUM_POINTS,
                    )  # fmt: skip
                v_tl = tl.load(value_ptr + top_row, mask=((inside & 1) != 0) & d_ok, other=0.0,
                               eviction_policy=VALUE_EVICTION)  # fmt: skip
                v_tr = tl.load(value_ptr + top_row + ROW, mask=((inside & 2) != 0) & d_ok, other=0.0,
                               eviction_policy=VALUE_EVICTION)  # fmt: skip
                v_bl = tl.load(value_ptr + bottom_row, mask=((inside & 4) != 0) & d_ok, other=0.0,
                               eviction_policy=VALUE_EVICTION)  # fmt: skip
                v_br = tl.load(value_ptr + bottom_row + ROW, mask=((inside & 8) != 0) & d_ok, other=0.0,
                               eviction_policy=VALUE_EVICTION)  # fmt: skip
                if LANE_UNROLL == 2:  # the second turn: none past the last
                    top_row_2, bottom_row_2, inside_2, w_tl_2, w_tr_2, w_bl_2, w_br_2 = _lane_turn(
                        row, below, corners, a_top, a_bottom, fx, k + 1, channel, k + 1 < TURNS, HEAD_DIM,
                        PACK_CORNERS, LANE_AXIS, SHUFFLE,
                    )  # fmt: skip
                    accumulator_2 = grad_value_ptr
                    if REPLICAS:
                        accumulator_2 = _turn_accumulator(
                            grad_value_ptr, replica_ptr, shifts, redirected, group + GROUPS * (k + 1 + LANES * r),
                            first_level, NUM_LEVELS, NUM_POINTS,
                        )  # fmt: skip
                    v_tl_2 = tl.load(value_ptr + top_row_2, mask=((inside_2 & 1) != 0) & d_ok, other=0.0,
                                     eviction_policy=VALUE_EVICTION)  # fmt: skip
                    v_tr_2 = tl.load(value_ptr + top_row_2 + ROW, mask=((inside_2 & 2) != 0) & d_ok, other=0.0,
                                     eviction_policy=VALUE_EVICTION)  # fmt: skip
                    v_bl_2 = tl.load(value_ptr + bottom_row_2, mask=((inside_2 & 4) != 0) & d_ok, other=0.0,
                                     eviction_policy=VALUE_EVICTION)  # fmt: skip
                    v_br_2 = tl.load(value_ptr + bottom_row_2 + ROW, mask=((inside_2 & 8) != 0) & d_ok, other=0.0,
                                     eviction_policy=VALUE_EVICTION)  # fmt: skip
                tl.atomic_add(accumulator + top_row, (w_tl * grad_out).to(ACCUMULATOR),
                              mask=((inside & 1) != 0) & d_ok, sem="relaxed")  # fmt: skip
                tl.atomic_add(accumulator + top_row + ROW, (w_tr * grad_out).to(ACCUMULATOR),
                              mask=((inside & 2) != 0) & d_ok, sem="relaxed")  # fmt: skip
                tl.atomic_add(accumulator + bottom_row, (w_bl * grad_out).to(ACCUMULATOR),
                              mask=((inside & 4) != 0) & d_ok, sem="relaxed")  # fmt: skip
                tl.atomic_add(accumulator + bottom_row + ROW, (w_br * grad_out).to(ACCUMULATOR),
                              mask=((inside & 8) != 0) & d_ok, sem="relaxed")  # fmt: skip
                if LANE_UNROLL == 2:
                    tl.atomic_add(accumulator_2 + top_row_2, (w_tl_2 * grad_out).to(ACCUMULATOR),
                                  mask=((inside_2 & 1) != 0) & d_ok, sem="relaxed")  # fmt: skip
                    tl.atomic_add(accumulator_2 + top_row_2 + ROW, (w_tr_2 * grad_out).to(ACCUMULATOR),
                                  mask=((inside_2 & 2) != 0) & d_ok, sem="relaxed")  # fmt: skip
                    tl.atomic_add(accumulator_2 + bottom_row_2, (w_bl_2 * grad_out).to(ACCUMULATOR),
                                  mask=((inside_2 & 4) != 0) & d_ok, sem="relaxed")  # fmt: skip
                    tl.atomic_add(accumulator_2 + bottom_row_2 + ROW, (w_br_2 * grad_out).to(ACCUMULATOR),
                                  mask=((inside_2 & 8) != 0) & d_ok, sem="relaxed")  # fmt: skip
                # Each dot summed over the row's threads, then kept by lane k.
                mine = lane == k
                dot_tl = tl.where(mine, _row_dot(v_tl, grad_out, LANE_AXIS), dot_tl)
                dot_tr = tl.where(mine, _row_dot(v_tr, grad_out, LANE_AXIS), dot_tr)
                dot_bl = tl.where(mine, _row_dot(v_bl, grad_out, LANE_AXIS), dot_bl)
                dot_br = tl.where(mine, _row_dot(v_br, grad_out, LANE_AXIS), dot_br)
                if LANE_UNROLL == 2:
                    mine = lane == k + 1
                    dot_tl = tl.where(mine, _row_dot(v_tl_2, grad_out, LANE_AXIS), dot_tl)
                    dot_tr = tl.where(mine, _row_dot(v_tr_2, grad_out, LANE_AXIS), dot_tr)
                    dot_bl = tl.where(mine, _row_dot(v_bl_2, grad_out, LANE_AXIS), dot_bl)
                    dot_br = tl.where(mine, _row_dot(v_br_2, grad_out, LANE_AXIS), dot_br)
            grad_attn = (1.0 - fy) * ((1.0 - fx) * dot_tl + fx * dot_tr) + fy * ((1.0 - fx) * dot_bl + fx * dot_br)
            grad_x = ((1.0 - fy) * (dot_tr - dot_tl) + fy * (dot_br - dot_bl)) * attn * w.to(tl.float32)
            grad_y = ((1.0 - fx) * (dot_bl - dot_tl) + fx * (dot_br - dot_tr)) * attn * h.to(tl.float32)
            tl.store(grad_attn_ptr + weight, grad_attn.to(grad_attn_ptr.dtype.element_ty), mask=ok)
            tl.store(grad_loc_ptr + 2 * param, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=ok)
            tl.store(grad_loc_ptr + 2 * param + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=ok)
    else:
        q_ok = (q < num_queries)[None, :]
        group = tl.arange(0, GROUPS)[:, None]
        channel = tl.arange(0, BLOCK_D // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        channel = channel[None, None, :, :]
        d_ok = channel < HEAD_DIM
        LK: tl.constexpr = NUM_LEVELS * NUM_POINTS
        ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
        first_param = ((b * num_queries + q[None, :]) * NUM_HEADS + m) * LK  # [1, BLOCK_Q]

        grad_out = tl.load(
            grad_out_ptr
            + b * grad_out_stride_b
            + q[None, :, None, None] * grad_out_stride_q
            + m * HEAD_DIM
            + channel,
            mask=q_ok[:, :, None, None] & d_ok,
            other=0.0,
        ).to(COMPUTE)  # [1, BLOCK_Q, BLOCK_D // CHUNK, CHUNK]

        if SOFTMAX:
            # The weights p = exp(logit - row_max) * row_scale (as in the forward). The softmax
            # backward, d logit_j = p_j * (g_j - sum_i p_i g_i) with g the gradient of the weights,
            # needs all L * K of a query's g before any d logit: the level loop writes each g to
            # scratch (in COMPUTE: a half-precision g would lose the bits that g - sum cancels) and
            # sums p * g per query; a last pass reads g back and writes d logit.
            row_max, row_scale = softmax_stats(attn_ptr, first_param, q_ok, group, LK, GROUPS, UNROLL, COMPUTE)
            weighted_grad = tl.zeros([GROUPS, BLOCK_Q], dtype=COMPUTE)  # p * g, summed over the samples

        ACCUMULATOR = grad_value_ptr.dtype.element_ty
        if FIXED_POINT:  # integer adds give the same sum in any order: bitwise deterministic
            fixed_point_scale = tl.load(fixed_point_scale_ptr)
        else:
            fixed_point_scale = 1.0

        # One loop over every level's steps, a step GROUPS * UNROLL points of one level. With PREFETCH
        # (one point a group a step) each step loads the next one's parameters, so that their latency
        # overlaps this step's gathers and reductions instead of preceding its placement.
        # Each program starts at another level (its query block's number modulo L) and wraps round:
        # programs in step would otherwise all add into the few rows of the coarse levels at once,
        # and same-address adds queue in L2 (the float16 decoder's kernel: 29.1 -> 26.5 us, entry 33).
        STEPS: tl.constexpr = (NUM_POINTS + GROUPS * UNROLL - 1) // (GROUPS * UNROLL)  # a level's steps
        MASKED_WEIGHT: tl.constexpr = float("-inf") if SOFTMAX else 0.0  # a masked logit's softmax weight is 0
        first_level = q_block % NUM_LEVELS
        start = b * 0  # the level's first row, in the index dtype
        used = b * 0  # replica rows (a batch) taken by the levels before
        if (not LEVEL_STARTS) or REPLICAS:  # both sums up to the first level
            for before in tl.static_range(NUM_LEVELS - 1):
                if before < first_level:
                    h = tl.load(shapes_ptr + 2 * before).to(b.dtype)
                    w = tl.load(shapes_ptr + 2 * before + 1).to(b.dtype)
                    if REPLICAS:
                        replicas, area = level_replicas(h, w, used, num_queries, replica_rows, NUM_POINTS)
                        used += (replicas - 1) * area
                    start += h * w
        if PREFETCH:  # step 0: the first level, point `group`
            tl.static_assert(UNROLL == 1, "the backward prefetches one point a group a step")
            mask = (group < NUM_POINTS) & q_ok
            first = first_param + first_level * NUM_POINTS + group
            next_attn = tl.load(attn_ptr + first, mask=mask, other=MASKED_WEIGHT)
            next_x = tl.load(loc_ptr + 2 * first, mask=mask, other=0.0)
            next_y = tl.load(loc_ptr + 2 * first + 1, mask=mask, other=0.0)
        for step in tl.range(0, NUM_LEVELS * STEPS):
            level = (step // STEPS + first_level) % NUM_LEVELS
            h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
            w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
            if LEVEL_STARTS:
                start = tl.load(starts_ptr + level).to(b.dtype)
            usable = level_ok(h, w, start, num_values)
            level_row = (b * num_values + start) * NUM_HEADS + m
            adds = d_ok  # the grad_value adds' mask beside the corners'
            if TILE_PIXELS > 0:  # that level's sums are shared_tile.py's kernel's where it fits its tile
                adds = d_ok & ((level != NUM_LEVELS - 1) | (h * w > TILE_PIXELS))
            # grad_value is summed at accumulator + corner (corner: the value element's offset), in
            # grad_value itself or, on a level with replicas, in the program's replica of its rows.
            accumulator = grad_value_ptr
            if REPLICAS:
                replicas, area = level_replicas(h, w, used, num_queries, replica_rows, NUM_POINTS)
                replica = q_block % replicas
                if replica > 0:
                    replica_row = (b * replica_rows + used + (replica - 1) * area) * NUM_HEADS + m
                    accumulator = replica_ptr + (replica_row - level_row) * HEAD_DIM
            if PREFETCH:
                attn_now, x_now, y_now = next_attn, next_x, next_y
                following = step + 1
                next_point = (following % STEPS) * GROUPS + group
                mask = (next_point < NUM_POINTS) & q_ok & (following < NUM_LEVELS * STEPS)
                next_level = (following // STEPS + first_level) % NUM_LEVELS
                next_param = first_param + next_level * NUM_POINTS + next_point
                next_attn = tl.load(attn_ptr + next_param, mask=mask, other=MASKED_WEIGHT)
                next_x = tl.load(loc_ptr + 2 * next_param, mask=mask, other=0.0)
                next_y = tl.load(loc_ptr + 2 * next_param + 1, mask=mask, other=0.0)
            for unrolled in tl.static_range(UNROLL):
                point = (step % STEPS) * (GROUPS * UNROLL) + unrolled * GROUPS + group
                mask = (point < NUM_POINTS) & q_ok
                param = first_param + level * NUM_POINTS + point  # [GROUPS, BLOCK_Q]
                if PREFETCH:
                    attn, x, y = attn_now, x_now, y_now
                else:
                    attn = tl.load(attn_ptr + param, mask=mask, other=MASKED_WEIGHT)
                    x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
                    y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
                attn = attn.to(COMPUTE)
                if SOFTMAX:  # masked logits -inf: weight exactly 0
                    attn = tl.exp(attn - row_max) * row_scale
                x0, y0, fx, fy, left, right, top, bottom = place_sample(x, y, h, w, usable, mask, COMPUTE)
                if not SOFTMAX:  # a softmax weight is finite or NaN already (sampling.softmax_stats)
                    attn = finite_or_nan(attn)
                if COUNT_STRIDE > 0:
                    # The deterministic mode's lists (deterministic.py) count here, where the sample is
                    # placed anyway, as msda_sample_lists_kernel will list it: under its
                    # top-left corner's pixel, if its left or right corner is inside. (A pass of its
                    # own waited on its atomics: 96 us at the bfloat16 encoder, bench/NOTES.md entry 38.)
                    # The count before this sample's is its rank in the list, its slot there: stored
                    # where msda_sample_lists_kernel reads it, then writes the sample's corner weights
                    # (an integer in a float's bits), so that pass needs no atomics of its own.
                    pixel = start + tl.maximum(y0, 0) * w + tl.maximum(x0, 0)
                    listed = left | right
                    rank = tl.atomic_add(
                        counts_ptr + ((b * NUM_HEADS + m) * num_values + pixel) * COUNT_STRIDE,
                        1,
                        mask=listed,
                        sem="relaxed",
                    )
                    tl.store(
                        list_ranks_ptr + 4 * param, rank_as_float(rank, list_ranks_ptr.dtype.element_ty), mask=listed
                    )
                corner = (level_row + (y0 * w + x0) * NUM_HEADS) * HEAD_DIM
                corner = corner[:, :, None, None] + channel
                below = corner + w * ROW
                # Each corner: its value row dotted with grad_out (for the location and attention
                # gradients), and attn * weight * grad_out scattered into grad_value. Many queries
                # can hit one value row, so that is an atomic add; relaxed: only the sum matters.
                # The four rows are loaded before any add: ptxas keeps a load after an atomic add
                # to memory it cannot tell apart (value and grad_value), so loads interleaved with
                # the adds wait for each other, four trips to L2 a step where one will do.
                # (Written out per corner: a helper taking both pointers would make torch.compile
                # believe the kernel writes `value`.)
                a_top = attn * (1.0 - fy)
                a_bottom = attn * fy
                v_tl = tl.load(
                    value_ptr + corner,
                    mask=(left & top)[:, :, None, None] & d_ok,
                    other=0.0,
                    eviction_policy=VALUE_EVICTION,
                )
                v_tr = tl.load(
                    value_ptr + corner + ROW,
                    mask=(right & top)[:, :, None, None] & d_ok,
                    other=0.0,
                    eviction_policy=VALUE_EVICTION,
                )
                v_bl = tl.load(
                    value_ptr + below,
                    mask=(left & bottom)[:, :, None, None] & d_ok,
                    other=0.0,
                    eviction_policy=VALUE_EVICTION,
                )
                v_br = tl.load(
                    value_ptr + below + ROW,
                    mask=(right & bottom)[:, :, None, None] & d_ok,
                    other=0.0,
                    eviction_policy=VALUE_EVICTION,
                )
                dot_tl = tl.sum(tl.sum(v_tl.to(COMPUTE) * grad_out, axis=3), axis=2)
                dot_tr = tl.sum(tl.sum(v_tr.to(COMPUTE) * grad_out, axis=3), axis=2)
                dot_bl = tl.sum(tl.sum(v_bl.to(COMPUTE) * grad_out, axis=3), axis=2)
                dot_br = tl.sum(tl.sum(v_br.to(COMPUTE) * grad_out, axis=3), axis=2)
                if GRAD_VALUE:
                    tl.atomic_add(
                        accumulator + corner,
                        _to_accumulator(
                            (a_top * (1.0 - fx))[:, :, None, None] * grad_out,
                            fixed_point_scale,
                            ACCUMULATOR,
                            FIXED_POINT,
                        ),
                        mask=(left & top)[:, :, None, None] & adds,
                        sem="relaxed",
                    )
                    tl.atomic_add(
                        accumulator + corner + ROW,
                        _to_accumulator(
                            (a_top * fx)[:, :, None, None] * grad_out, fixed_point_scale, ACCUMULATOR, FIXED_POINT
                        ),
                        mask=(right & top)[:, :, None, None] & adds,
                        sem="relaxed",
                    )
                    tl.atomic_add(
                        accumulator + below,
                        _to_accumulator(
                            (a_bottom * (1.0 - fx))[:, :, None, None] * grad_out,
                            fixed_point_scale,
                            ACCUMULATOR,
                            FIXED_POINT,
                        ),
                        mask=(left & bottom)[:, :, None, None] & adds,
                        sem="relaxed",
                    )
                    tl.atomic_add(
                        accumulator + below + ROW,
                        _to_accumulator(
                            (a_bottom * fx)[:, :, None, None] * grad_out, fixed_point_scale, ACCUMULATOR, FIXED_POINT
                        ),
                        mask=(right & bottom)[:, :, None, None] & adds,
                        sem="relaxed",
                    )
                grad_attn = (1.0 - fy) * ((1.0 - fx) * dot_tl + fx * dot_tr) + fy * ((1.0 - fx) * dot_bl + fx * dot_br)
                # d/dx_im of the bilinear weights, then the chain rule through x_im = x * W - 0.5.
                grad_x = ((1.0 - fy) * (dot_tr - dot_tl) + fy * (dot_br - dot_bl)) * attn * w.to(COMPUTE)
                grad_y = ((1.0 - fx) * (dot_bl - dot_tl) + fx * (dot_br - dot_tr)) * attn * h.to(COMPUTE)
                if SOFTMAX:
                    tl.store(scratch_ptr + param, grad_attn.to(scratch_ptr.dtype.element_ty), mask=mask)
                    weighted_grad += tl.where(mask, attn * grad_attn, 0.0)
                else:
                    tl.store(grad_attn_ptr + param, grad_attn.to(grad_attn_ptr.dtype.element_ty), mask=mask)
                tl.store(grad_loc_ptr + 2 * param, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=mask)
                tl.store(grad_loc_ptr + 2 * param + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=mask)
            # After a level's last step: the next level's first row and replica row (0 after the last level).
            level_done = step % STEPS == STEPS - 1
            wraps = level == NUM_LEVELS - 1
            if not LEVEL_STARTS:
                start = tl.where(level_done, tl.where(wraps, start * 0, start + h * w), start)
            if REPLICAS:
                used = tl.where(level_done, tl.where(wraps, used * 0, used + (replicas - 1) * area), used)

        if SOFTMAX:
            weighted_sum = tl.sum(weighted_grad, axis=0, keep_dims=True)  # [1, BLOCK_Q]
            tl.debug_barrier()  # every g of the program's queries written (by whichever thread)
            for step in tl.range(0, LK, GROUPS * UNROLL):
                for unrolled in tl.static_range(UNROLL):
                    j = step + unrolled * GROUPS + group
                    mask = (j < LK) & q_ok
                    logit = tl.load(attn_ptr + first_param + j, mask=mask, other=float("-inf")).to(COMPUTE)
                    p = tl.exp(logit - row_max) * row_scale
                    g = tl.load(scratch_ptr + first_param + j, mask=mask, other=0.0).to(COMPUTE)
                    grad_logit = p * (g - weighted_sum)
                    # scratch may be grad_attn itself: every thread holding this element has read
                    # its g before any writes d logit over it.
                    tl.debug_barrier()
                    tl.store(grad_attn_ptr + first_param + j, grad_logit.to(grad_attn_ptr.dtype.element_ty), mask=mask)

    if FOLD_PIXELS > 0:
        # Few replica rows (launch.fold_in_kernel: the decoders'): the last program of each
        # (batch, head) to finish folds that head's replicas into grad_value, in place of a
        # kernel of its own (a launch of mostly idle programs: no decoder level takes replicas
        # at the presets). Each program counts itself done in counts_ptr[b, m] after its adds:
        # the barrier orders every thread's adds before thread 0's count (a release at GPU
        # scope); the program that counts last acquires them all, and reads the replicas from
        # L2 (".cg": not its L1). (Inline, as the lane placement's offsets: a helper given
        # shapes_ptr, entry 38. Names of their own: the branches above leave theirs.)
        tl.static_assert(REPLICAS, "FOLD_PIXELS folds replicas")
        # Runtime loops over the levels (tl.range): unrolled, the fold took 19 s to compile at
        # L = 16 on this repository's CPU machine, against 2 s without it (scripts/compile_check.py).
        spread = b * 0  # the batch's replica rows in use: none at the decoders, so no count
        for each in tl.range(0, NUM_LEVELS):
            fold_h = tl.load(shapes_ptr + 2 * each).to(b.dtype)
            fold_w = tl.load(shapes_ptr + 2 * each + 1).to(b.dtype)
            fold_replicas, fold_area = level_replicas(fold_h, fold_w, spread, num_queries, replica_rows, NUM_POINTS)
            spread += (fold_replicas - 1) * fold_area
        if spread > 0:
            tl.debug_barrier()
            programs_done = tl.atomic_add(counts_ptr + b * NUM_HEADS + m, 1, sem="acq_rel", scope="gpu")
            if programs_done == num_q_blocks - 1:
                FOLD_ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
                fold_channel = m * HEAD_DIM + tl.arange(0, BLOCK_D)[None, :]
                fold_channel_ok = tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM
                taken = b * 0  # replica rows of the levels before
                fold_start = b * 0
                for each in tl.range(0, NUM_LEVELS):
                    fold_h = tl.load(shapes_ptr + 2 * each).to(b.dtype)
                    fold_w = tl.load(shapes_ptr + 2 * each + 1).to(b.dtype)
                    if LEVEL_STARTS:
                        fold_start = tl.load(starts_ptr + each).to(b.dtype)
                    fold_replicas, fold_area = level_replicas(
                        fold_h, fold_w, taken, num_queries, replica_rows, NUM_POINTS
                    )
                    # The kernel added nothing on an unusable level, and nothing past its area.
                    if (fold_replicas > 1) & level_ok(fold_h, fold_w, fold_start, num_values):
                        first_pixel = b * 0  # while loops: the interpreter's range takes no loaded bound
                        while first_pixel < fold_area:
                            fold_pixel = first_pixel + tl.arange(0, FOLD_PIXELS)[:, None]
                            # Every replica but copy 0 (grad_value itself), in the fold kernel's order.
                            add_replicas(
                                grad_value_ptr, replica_ptr, b * num_values + fold_start, b * replica_rows + taken,
                                fold_pixel, fold_channel, (fold_pixel < fold_area) & fold_channel_ok, fold_area,
                                b * 0 + 1, fold_replicas, FOLD_ROW, FOLD_UNROLL, ".cg",
                            )  # fmt: skip
                            first_pixel += FOLD_PIXELS
                    taken += (fold_replicas - 1) * fold_area
                    if not LEVEL_STARTS:
                        fold_start += fold_h * fold_w


@triton.jit
def _lane_turn(
    row, below, corners, a_top, a_bottom, fx, k, channel, valid,
    HEAD_DIM: tl.constexpr, PACK_CORNERS: tl.constexpr, LANE_AXIS: tl.constexpr, SHUFFLE: tl.constexpr,
):  # fmt: skip
    """Lane k's sample as each thread of its row takes it in turn k of the lane placement: the
    element offsets of its top and bottom corner rows at the thread's `channel`s, which corners
    are inside (bits 1, 2, 4 and 8: top left, top right, bottom left, bottom right; none where
    not `valid`) and the four corners' weights. Takes no pointers (sampling.py says why)."""
    if PACK_CORNERS:
        inside = from_lane(row, k, LANE_AXIS, SHUFFLE)
        # Multiples of 16, said so (`& -16` holds the hint: on a shuffle's result Triton drops
        # it), or Triton would not vectorize the loads and adds.
        top_row = tl.multiple_of(inside & -16, [16, 16, 16, 16]) + channel
        bottom_row = from_lane(below, k, LANE_AXIS, SHUFFLE)
        bottom_row = tl.multiple_of(bottom_row & -16, [16, 16, 16, 16]) + channel
    else:
        inside = from_lane(corners, k, LANE_AXIS, SHUFFLE)
        top_row = from_lane(row, k, LANE_AXIS, SHUFFLE) * HEAD_DIM + channel
        bottom_row = from_lane(below, k, LANE_AXIS, SHUFFLE) * HEAD_DIM + channel
    inside = tl.where(valid, inside, 0)
    a_top_k = from_lane(a_top, k, LANE_AXIS, SHUFFLE)
    a_bottom_k = from_lane(a_bottom, k, LANE_AXIS, SHUFFLE)
    fx_k = from_lane(fx, k, LANE_AXIS, SHUFFLE)
    return (
        top_row, bottom_row, inside,
        a_top_k * (1.0 - fx_k), a_top_k * fx_k, a_bottom_k * (1.0 - fx_k), a_bottom_k * fx_k,
    )  # fmt: skip


@triton.jit
def _turn_accumulator(
    grad_value_ptr, replica_ptr, shifts, redirected, sample, first_level,
    NUM_LEVELS: tl.constexpr, NUM_POINTS: tl.constexpr,
):  # fmt: skip
    """Where a turn of the lane placement adds its samples' corners (at the offsets of their
    grad_value elements): grad_value, or the program's replica of their level's rows (the
    kernel's `shifts` and `redirected`). sample: the turn's sample of each group, [1, GROUPS, 1, 1]
    (one past the last is masked by the caller)."""
    level = (sample // NUM_POINTS + first_level) % NUM_LEVELS
    shift = level * 0
    to_replica = level < 0
    for each in tl.static_range(NUM_LEVELS):
        shift = tl.where(level == each, shifts[each], shift)
        to_replica = tl.where(level == each, redirected[each], to_replica)
    # Both start on 16 bytes (`grad_value_buffer`), and shift is in whole rows of 16-byte vectors
    # (the lane placement's rows are): said so, as triton 3.7 and 3.8 lose it through the select
    # and add element by element, each add a scalar atomic (3.6 keeps it: v4 / v8 atomics).
    return tl.multiple_of(tl.where(to_replica, replica_ptr + shift, grad_value_ptr), [16, 16, 16, 16])


@triton.jit
def _row_dot(rows, grad_out, LANE_AXIS: tl.constexpr):
    """Each row of the lane placement's tile `rows` (a row's channels over its LANES threads:
    sampling.lane_tile) dotted with grad_out, in float32, the sum in every thread of the row."""
    return tl.sum(tl.sum(rows.to(tl.float32) * grad_out, axis=3, keep_dims=True), axis=LANE_AXIS, keep_dims=True)


@triton.jit
def _to_accumulator(contribution, fixed_point_scale, ACCUMULATOR: tl.constexpr, FIXED_POINT: tl.constexpr):
    """A grad_value contribution in the accumulator's dtype: with FIXED_POINT the integer
    round-toward-zero(contribution * scale), else a cast."""
    if FIXED_POINT:
        return (contribution * fixed_point_scale).to(tl.int64)
    return contribution.to(ACCUMULATOR)


# Where many samples land on one value row, their atomic adds queue at the same L2 addresses,
# and in half precision each add rounds: the coarsest level of the encoder preset gets 326
# samples a pixel (about 1,300 adds a row), and summing that in float16 misses the accuracy
# bound (grad_value 2.9e-3 against 2e-3; bfloat16 2.2e-2 against 1.6e-2). So a level with more
# than SAMPLES_PER_REPLICA samples a pixel (Q * K / (H * W)) is summed into several replicas of
# its rows, each program into one (its query block's number modulo their count), and a second
# kernel folds the replicas into grad_value. Each replica sums about SAMPLES_PER_REPLICA samples
# a pixel, as a level of 21 does without any (level 1 of the encoder), and the adds spread over
# more addresses. On the H200 the float16 encoder backward with replicas took 587 us with
# grad_value 1.3e-3 off, against 606 us and 2.9e-3 without them, and 897 us and 2.1e-4 with a
# float32 accumulator, as before (bfloat16: 588, 622 and 888 us; 9.8e-3, 2.2e-2 and 1.7e-3;
# `python -m bench.accumulator`, bench/NOTES.md entry 33).
SAMPLES_PER_REPLICA = tl.constexpr(24)


@triton.jit
def level_replicas(h, w, used, num_queries, replica_rows, NUM_POINTS: tl.constexpr):
    """(count, area): how many copies of an h x w level's rows its adds are spread over (1: only
    grad_value's own), and h * w (at least 1). The copies after the first take (count - 1) * area
    rows of the replica buffer from row `used` on; a level gets fewer where the buffer's
    `replica_rows` run out (finest level first), never more than fit."""
    area = tl.maximum(h * w, 1)
    wanted = tl.cdiv(tl.cdiv(num_queries * NUM_POINTS, area), SAMPLES_PER_REPLICA)
    room = 1 + (replica_rows - used) // area
    return tl.maximum(tl.minimum(wanted, room), 1), area


@triton.jit
def add_replicas(
    grad_value_ptr, replica_ptr, level_row, level_replica_row, pixel, element, mask, area, first, last,
    ROW: tl.constexpr, UNROLL: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """grad_value's rows level_row + pixel += the sum of their replicas [first, last), added in
    replica order (replica r of a pixel: replica row level_replica_row + (r - 1) * area + pixel;
    replica 0 is grad_value itself), at the `element`s of each ROW-wide row that `mask` allows.
    The fold kernel's sum and the backward kernel's own fold (FOLD_PIXELS) both take it, so the
    two add in one order. The loads and the add stay here, with the pointers (no row offsets
    returned): torch.compile's analysis then sees grad_value_ptr alone written (entry 9)."""
    total = tl.zeros(mask.shape, dtype=tl.float32)
    replica = first  # a while loop: the interpreter's range takes no loaded bound
    while replica < last:
        for j in tl.static_range(UNROLL):
            row = level_replica_row + (replica + j - 1) * area + pixel
            loaded = mask & (replica + j < last)
            total += tl.load(replica_ptr + row * ROW + element, mask=loaded, other=0.0, cache_modifier=CACHE).to(
                tl.float32
            )
        replica += UNROLL
    # An atomic add, not a store: levels may overlap (only MSDA_VALIDATE rules that out).
    tl.atomic_add(
        grad_value_ptr + (level_row + pixel) * ROW + element,
        total.to(grad_value_ptr.dtype.element_ty),
        mask=mask,
        sem="relaxed",
    )


@triton.jit(do_not_specialize=["num_queries", "num_values", "replica_rows"])
def msda_fold_replicas_kernel(
    grad_value_ptr,  # (B, S, M, D), as the backward kernel left it
    replica_ptr,  # (B, replica_rows, M, D), as the backward kernel left it
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    num_queries,
    num_values,
    replica_rows,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    ROW: tl.constexpr,  # M * D: a pixel's elements, every head
    BLOCK_ROW: tl.constexpr,  # ROW's next power of two
    BLOCK_PIXELS: tl.constexpr,
    REPLICAS_A_PROGRAM: tl.constexpr,  # at least this many replicas a program sums (one rounding of grad_value)
    UNROLL: tl.constexpr,  # replicas' loads issued together
    INDEX_64: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,
):
    """grad_value += the sum of each replica of a level's rows: a program takes BLOCK_PIXELS
    pixels of one level of one batch, for every head, and a run of their replicas. The grid
    covers replica_rows pixels a level, which no level with replicas has: a level's spare
    programs split its replicas into runs of REPLICAS_A_PROGRAM or more (a level of a few
    pixels can have a hundred replicas, whose loads one program would wait for one by one)."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    num_blocks = tl.cdiv(replica_rows, BLOCK_PIXELS)
    block = pid % num_blocks
    level = (pid // num_blocks) % NUM_LEVELS
    b = pid // num_blocks // NUM_LEVELS
    # The levels before this one: the replica rows they took, and where this one starts.
    used = b * 0
    start = b * 0
    for before in tl.static_range(NUM_LEVELS - 1):
        if before < level:
            h = tl.load(shapes_ptr + 2 * before).to(b.dtype)
            w = tl.load(shapes_ptr + 2 * before + 1).to(b.dtype)
            replicas, area = level_replicas(h, w, used, num_queries, replica_rows, NUM_POINTS)
            used += (replicas - 1) * area
            start += h * w
    h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
    w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
    if LEVEL_STARTS:
        start = tl.load(starts_ptr + level).to(b.dtype)
    replicas, area = level_replicas(h, w, used, num_queries, replica_rows, NUM_POINTS)
    # The level's pixel blocks, each taken by `runs` programs (at least 1 where the level has
    # replicas: their rows, (replicas - 1) * area, fit in replica_rows), each summing a run of
    # replicas [first, last) of them: replica 0 is grad_value itself, so a level without
    # replicas has no runs.
    pixel_blocks = tl.cdiv(area, BLOCK_PIXELS)
    runs = num_blocks // pixel_blocks
    run = block // pixel_blocks
    run_length = tl.maximum(tl.cdiv(replicas - 1, tl.maximum(runs, 1)), REPLICAS_A_PROGRAM)
    first = 1 + run * run_length  # (may wrap round past the last run, which is not summed)
    last = tl.minimum(first + run_length, replicas)
    # The backward kernel added nothing on an unusable level, and nothing past its area.
    if level_ok(h, w, start, num_values) & (run < tl.cdiv(replicas - 1, run_length)):
        pixel = (block % pixel_blocks) * BLOCK_PIXELS + tl.arange(0, BLOCK_PIXELS)[:, None]
        element = tl.arange(0, BLOCK_ROW)[None, :]
        add_replicas(
            grad_value_ptr, replica_ptr, b * num_values + start, b * replica_rows + used, pixel, element,
            (pixel < area) & (element < ROW), area, first, last, ROW, UNROLL, "",
        )  # fmt: skip


def grad_value_accumulator_dtype(value: torch.Tensor, num_queries, num_levels: int, num_points: int) -> torch.dtype:
    """The dtype of the buffer the backward kernel scatters grad_value into: value's own, but
    float32 for bfloat16 where its atomic add is emulated (before sm_90: a compare-and-swap loop)
    or missing (the interpreter, on the CPU), and float32 for a small grad_value with dense
    samples (`NATIVE_MIN_ELEMENTS`). Takes SymInts (then guards on both comparisons)."""
    if value.dtype not in (torch.float16, torch.bfloat16):
        return value.dtype
    if value.dtype == torch.bfloat16 and (
        value.device.type != "cuda" or torch.cuda.get_device_capability(value.device) < (9, 0)
    ):
        return torch.float32
    sparse = num_queries * num_levels * num_points <= NATIVE_MAX_SAMPLES_PER_ROW * value.shape[1]
    if sparse or value.numel() >= NATIVE_MIN_ELEMENTS:
        return value.dtype
    return torch.float32


# Half-precision adds keep the error of grad_value within the bounds as a norm over many
# elements: each element's rounding is a random walk, and the norm averages them. A grad_value of
# a few elements whose sums cancel has no such average: the GPU fuzz found one of 1 element (45
# samples on a 1 x 1 level, float16) at 1.9e-2 against 2e-3. Below this many elements, where
# speed hardly matters, dense samples are summed in float32 (the smallest value of a Deformable
# DETR layer at a 256 x 256 image, 348 k elements, is below it; the presets, 11 M and 23 M, above).
NATIVE_MIN_ELEMENTS = 2**20
# ... but where a (batch, head) has at most this many samples a value row (Q * L * K = 4,800 over
# S = 22,223 at the decoder preset; the coarsest level there has 4.4 samples a pixel), a grad_value
# of any size sums in its own dtype.
NATIVE_MAX_SAMPLES_PER_ROW = 0.25


def replica_rows(
    accumulator: torch.dtype, num_queries, num_values, num_levels: int, num_points: int, *, force: bool = False
):
    """Rows a batch of the replica buffer, at least 1, for every half-precision accumulator (None:
    no replicas: float32 and float64 accumulators add exactly enough, and a float32 encoder
    backward ran 902 us with them against 890 without, entry 33). Which levels take replicas is
    the kernels' choice (`level_replicas`), from the level sizes, which live on the device: the
    shapes alone cannot rule out a level of a few pixels under many queries at any density (the
    GPU fuzz found 4 levels of 1 x 1 beside one of 31 x 30, 0.996 samples a value row, with
    bfloat16's grad_value 2.2e-2 off unreplicated; bench/NOTES.md entry 97). A level's replicas
    take at most Q * K / SAMPLES_PER_REPLICA rows, so L times that always suffices; but at most
    S / 2 (levels past that get fewer replicas), for memory: in half precision grad_value and its
    replicas together should stay near a float32 grad_value's size. Takes SymInts, with no branch
    on them. force: rows whatever the accumulator (bench.tune's forced replicas)."""
    if not force and accumulator not in (torch.float16, torch.bfloat16):
        return None
    samples = num_queries * num_levels * num_points
    return torch.sym_max(1, torch.sym_min(samples // SAMPLES_PER_REPLICA.value, num_values // 2))


def folds_in_kernel(replica_rows, head_dim: int) -> bool:
    """Whether the backward kernel folds the replicas itself (its last program of each (batch,
    head), after its adds), not msda_fold_replicas_kernel: where a head's replica rows hold at
    most FOLD_IN_KERNEL_ELEMENTS elements. One program then folds a head's replicas after the
    kernel's other programs: a short tail where few rows are in use, and none at all where no
    level takes replicas (the decoders at the presets), against a launch of mostly idle
    programs. More rows (DINO's, the encoders': 355 k elements a head at the preset) take the
    fold kernel, whose programs share them. Takes SymInts (then guards on the comparison)."""
    return replica_rows * head_dim <= FOLD_IN_KERNEL_ELEMENTS


# The decoder preset's 6,400 (200 rows of 32 channels, none used there), RT-DETR's 4,800; not
# DINO's 900 queries (19,200). A program of one warp (the decoders') folding them all would take
# about 4 us, 13 steps of 16 pixels, against the fold kernel's 2-3 (bench/NOTES.md entry 98).
FOLD_IN_KERNEL_ELEMENTS = 2**13


# The deterministic mode (torch.use_deterministic_algorithms(True)) sums grad_value in 64-bit
# fixed point: each contribution times a power of two 2**e, rounded toward zero to an integer,
# added with integer atomics (associative: the same bits in any order), then converted back and
# divided by 2**e. e is chosen per call, on the device (no synchronization), from a bound on
# any element's sum: a value row is a corner of at most Q * L * K samples of its (batch, head)
# (Q * K of its own level; L for levels that overlap, which only MSDA_VALIDATE rules out), each
# adding |attention weight * bilinear weight * grad_output| <= max|attention weight| *
# max|grad_output|. So with that bound below 2**e0, e = 62 - e0 keeps every
# sum below 2**62 (no overflow) and each contribution's rounding below 2**-62 of the bound: at
# the encoder preset (Q * L * K = 2**18.4) that is 2**-43 of the largest contribution, finer than
# a float32 atomic add's rounding. A non-finite grad_output or weight makes the bound non-finite:
# then the whole grad_value is NaN (integers cannot carry inf or NaN).
FIXED_POINT_BITS = 62


def fixed_point_scale(
    grad_output: torch.Tensor, attention_weights: torch.Tensor | None, samples_per_row: int
) -> torch.Tensor:
    """2**e as a one-element float32 tensor on the device (see above); attention_weights None:
    they are softmax weights, at most 1."""
    bound = _largest_magnitude(grad_output) * samples_per_row
    if attention_weights is not None:
        bound = bound * _largest_magnitude(attention_weights)
    _, exponent = torch.frexp(bound)  # bound < 2**exponent (exponent 0 for 0, inf and NaN)
    exponent = (FIXED_POINT_BITS - exponent).clamp(min=-126, max=127)
    scale = torch.ldexp(torch.ones_like(bound), exponent)
    # Non-finite bound: NaN scale, so that the conversion back gives NaN everywhere.
    return torch.where(torch.isfinite(bound), scale, torch.nan).reshape(1)


def _largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """max |t| in float32 (NaN if t has one), without abs's full-size temporary: one pass."""
    smallest, largest = torch.aminmax(t.detach())
    return torch.maximum(-smallest, largest).float()


def from_fixed_point(accumulator: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_value from its 64-bit fixed-point sums: one rounding to float32 (exact integer sums),
    an exact division by the power of two, then the value's dtype."""
    # One pass: int64 times a float32 tensor computes in float32 (the integer rounded once).
    grad_value = accumulator * scale.reciprocal()
    return grad_value if grad_value.dtype == dtype else grad_value.to(dtype)


# Replica rows of at most 1 / ONE_FILL_REPLICA_SHARE of grad_value's share its allocation, and
# its fill: one launch less (the decoders' replicas, 0.9% of grad_value at the preset, are seldom
# used), for a storage that much larger under the grad_value returned. Traced calls keep their
# own torch.zeros (the compiler makes the fills).
ONE_FILL_REPLICA_SHARE = 16


def grad_value_buffer(
    value: torch.Tensor,
    grad_output: torch.Tensor,
    attention_weights: torch.Tensor | None,
    num_queries: int,
    num_levels: int,
    num_points: int,
    lists: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(zeros the kernel scatters grad_value into, fixed-point scale or None, zeros for the
    replicas of dense levels or None, int32 zeros (B, M) for the backward kernel to fold the
    replicas itself or None). Under torch.use_deterministic_algorithms(True): int64 and its scale
    (attention_weights None: softmax weights, at most 1), no replicas; with `lists` no buffer at
    all (None: kernels/deterministic.py sums grad_value); else `grad_value_accumulator_dtype`'s
    dtype, with replicas where `replica_rows` asks for them, folded in the backward kernel where
    `folds_in_kernel` says."""
    if torch.are_deterministic_algorithms_enabled():
        if lists:
            return None, None, None, None
        scale = fixed_point_scale(grad_output, attention_weights, num_queries * num_levels * num_points)
        return torch.zeros(value.shape, dtype=torch.int64, device=value.device), scale, None, None
    dtype = grad_value_accumulator_dtype(value, num_queries, num_levels, num_points)
    plain = type(value) is torch.Tensor  # not traced (fake or functional tensors under compile and export)
    B, S, M, D = value.shape
    rows = replica_rows(dtype, num_queries, S, num_levels, num_points)
    if rows is None:
        return _zeros(value, value.shape, dtype, plain), None, None, None
    in_kernel = folds_in_kernel(rows, D)
    if plain and rows * ONE_FILL_REPLICA_SHARE <= S:
        # Few replica rows (the decoders): grad_value, the replicas and the counts in one
        # allocation and one fill, each from a 16-byte boundary as an allocation of its own would
        # start (the kernels' pointers are compiled for it).
        replicas_at = _aligned(value.numel())
        counts_at = _aligned(replicas_at + B * rows * M * D)
        count_elements = -(-4 * B * M // dtype.itemsize) if in_kernel else 0
        zeros = zero_(value.new_empty(counts_at + count_elements, dtype=dtype))
        grad_value = zeros[: value.numel()].view(value.shape)
        replicas = zeros[replicas_at : replicas_at + B * rows * M * D].view(B, rows, M, D)
        counts = zeros[counts_at:].view(torch.int32)[: B * M].view(B, M) if in_kernel else None
        return grad_value, None, replicas, counts
    counts = _zeros(value, (B, M), torch.int32, plain) if in_kernel else None
    return _zeros(value, value.shape, dtype, plain), None, _zeros(value, (B, rows, M, D), dtype, plain), counts


def _aligned(elements: int) -> int:
    """`elements` rounded up to a multiple of 8 (16 bytes of 2-byte elements, more of wider ones)."""
    return -(-elements // 8) * 8


def _zeros(like: torch.Tensor, shape, dtype: torch.dtype, plain: bool) -> torch.Tensor:
    """Zeros of `shape` and `dtype` on `like`'s device, contiguous; plain (not traced), allocated
    from `like` (less host time than torch.empty: bench/NOTES.md entry 71) and zeroed by `zero_`.
    Traced calls keep torch.zeros: the compiler makes its own fill."""
    if not plain:
        return torch.zeros(shape, dtype=dtype, device=like.device)
    if shape == like.shape:
        return zero_(torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format))
    return zero_(like.new_empty(shape, dtype=dtype))


def zero_(tensor: torch.Tensor) -> torch.Tensor:
    """tensor.zero_() for a contiguous tensor, 2-byte elements written as 4-byte words where the
    last dimension pairs them up: PyTorch's fill kernel writes 2-byte elements slower (on the
    H200, the decoder's 45 MB float16 grad_value took 14.9 us, as int32 11.6; bench/NOTES.md
    entry 34)."""
    if tensor.element_size() == 2 and tensor.shape[-1] % 2 == 0 and tensor.is_contiguous():
        tensor.view(torch.int32).zero_()
    else:
        tensor.zero_()
    return tensor


def finish_grad_value(buffer: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """grad_value in `dtype` from what `grad_value_buffer` gave and the kernel summed."""
    if scale is not None:
        return from_fixed_point(buffer, scale, dtype)
    return buffer if buffer.dtype == dtype else buffer.to(dtype)
