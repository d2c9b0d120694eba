"""The MSDA backward kernel (all three gradients in one pass) and the
rule that picks the dtype `grad_value` is accumulated in."""

import torch
import triton
import triton.language as tl

from .sampling import finite_or_nan, level_ok, place_sample, softmax_stats


# Sizes and strides vary with the image: not specialized (see forward.py).
@triton.jit(
    do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "num_values"]
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
    grad_value_ptr,  # (B, S, M, D) zeros: value's dtype or the float32 accumulator
    grad_loc_ptr,  # like loc
    grad_attn_ptr,  # like attn
    scratch_ptr,  # with SOFTMAX: (B, Q, M, L, K) in COMPUTE, may be grad_attn itself; else unused
    num_queries,
    num_values,
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
):
    # The forward's program layout and tile (msda/kernels/forward.py explains both).
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

    start = b * 0  # the level's first row, in the index dtype
    for level in tl.range(0, NUM_LEVELS):
        h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
        w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
        if LEVEL_STARTS:
            start = tl.load(starts_ptr + level).to(b.dtype)
        usable = level_ok(h, w, start, num_values)
        level_row = (b * num_values + start) * NUM_HEADS + m
        for point_step in tl.range(0, NUM_POINTS, GROUPS * UNROLL):
            for unrolled in tl.static_range(UNROLL):
                point = point_step + unrolled * GROUPS + group
                mask = (point < NUM_POINTS) & q_ok
                param = first_param + level * NUM_POINTS + point  # [GROUPS, BLOCK_Q]
                if SOFTMAX:  # masked logits -inf: weight exactly 0
                    attn = tl.load(attn_ptr + param, mask=mask, other=float("-inf")).to(COMPUTE)
                    attn = tl.exp(attn - row_max) * row_scale
                else:
                    attn = tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE)
                x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
                y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
                x0, y0, fx, fy, left, right, top, bottom = place_sample(x, y, h, w, usable, mask, COMPUTE)
                attn = finite_or_nan(attn)
                corner = (level_row + (y0 * w + x0) * NUM_HEADS) * HEAD_DIM
                corner = corner[:, :, None, None] + channel
                below = corner + w * ROW
                # Each corner: its value row dotted with grad_out (for the location and attention
                # gradients), and attn * weight * grad_out scattered into grad_value. Many queries
                # can hit one value row, so that is an atomic add; relaxed: only the sum matters.
                # (Written out per corner: a helper taking both pointers would make torch.compile
                # believe the kernel writes `value`.)
                a_top = attn * (1.0 - fy)
                a_bottom = attn * fy
                v = tl.load(value_ptr + corner, mask=(left & top)[:, :, None, None] & d_ok, other=0.0)
                dot_tl = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
                tl.atomic_add(
                    grad_value_ptr + corner,
                    ((a_top * (1.0 - fx))[:, :, None, None] * grad_out).to(grad_value_ptr.dtype.element_ty),
                    mask=(left & top)[:, :, None, None] & d_ok,
                    sem="relaxed",
                )
                v = tl.load(value_ptr + corner + ROW, mask=(right & top)[:, :, None, None] & d_ok, other=0.0)
                dot_tr = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
                tl.atomic_add(
                    grad_value_ptr + corner + ROW,
                    ((a_top * fx)[:, :, None, None] * grad_out).to(grad_value_ptr.dtype.element_ty),
                    mask=(right & top)[:, :, None, None] & d_ok,
                    sem="relaxed",
                )
                v = tl.load(value_ptr + below, mask=(left & bottom)[:, :, None, None] & d_ok, other=0.0)
                dot_bl = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
                tl.atomic_add(
                    grad_value_ptr + below,
                    ((a_bottom * (1.0 - fx))[:, :, None, None] * grad_out).to(grad_value_ptr.dtype.element_ty),
                    mask=(left & bottom)[:, :, None, None] & d_ok,
                    sem="relaxed",
                )
                v = tl.load(value_ptr + below + ROW, mask=(right & bottom)[:, :, None, None] & d_ok, other=0.0)
                dot_br = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
                tl.atomic_add(
                    grad_value_ptr + below + ROW,
                    ((a_bottom * fx)[:, :, None, None] * grad_out).to(grad_value_ptr.dtype.element_ty),
                    mask=(right & bottom)[:, :, None, None] & d_ok,
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
        if not LEVEL_STARTS:
            start += h * w

    if SOFTMAX:
        weighted_sum = tl.sum(weighted_grad, axis=0, keep_dims=True)  # [1, BLOCK_Q]
        tl.debug_barrier()  # every g of the program's queries written (by whichever thread)
        for step in tl.range(0, LK, GROUPS * UNROLL):
            for unrolled in tl.static_range(UNROLL):
                j = step + unrolled * GROUPS + group
                mask = (j < LK) & q_ok
                logit = tl.load(attn_ptr + first_param + j, mask=mask, other=float("-inf")).to(COMPUTE)
                p = finite_or_nan(tl.exp(logit - row_max) * row_scale)
                g = tl.load(scratch_ptr + first_param + j, mask=mask, other=0.0).to(COMPUTE)
                grad_logit = p * (g - weighted_sum)
                # scratch may be grad_attn itself: every thread holding this element has read
                # its g before any writes d logit over it.
                tl.debug_barrier()
                tl.store(grad_attn_ptr + first_param + j, grad_logit.to(grad_attn_ptr.dtype.element_ty), mask=mask)


# Half-precision atomics round at every add. That costs nothing where few samples land on each
# value row (the decoder: Q*L*K = 4,800 samples over S = 22,223 rows per (batch, head)) and
# misses the accuracy bounds where many do (the encoder: 16 samples a row on average, hundreds on
# the coarsest level). So float16/bfloat16 gradients accumulate in a float32 buffer, cast at
# the end, unless the samples of a (batch, head) are at most this fraction of its value rows.
HALF_ATOMICS_MAX_SAMPLES_PER_ROW = 0.25


def grad_value_accumulator_dtype(
    value_dtype: torch.dtype,
    device: torch.device,
    num_queries: int,
    num_values: int,
    num_levels: int,
    num_points: int,
) -> torch.dtype:
    """The dtype of the buffer the backward kernel scatters grad_value into."""
    if value_dtype in (torch.float32, torch.float64):
        return value_dtype
    sparse = num_queries * num_levels * num_points <= HALF_ATOMICS_MAX_SAMPLES_PER_ROW * num_values
    if not sparse:
        return torch.float32
    if value_dtype == torch.bfloat16 and (
        device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0)
    ):
        # Before sm_90 a bfloat16 atomic add is emulated with a compare-and-swap loop, and the
        # interpreter (CPU) has none at all.
        return torch.float32
    return value_dtype
