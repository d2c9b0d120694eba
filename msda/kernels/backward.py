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
    grad_value_ptr,  # (B, S, M, D) zeros: value's dtype, the float32 accumulator, or int64 (FIXED_POINT)
    fixed_point_scale_ptr,  # with FIXED_POINT: the float32 scale of grad_value's integers; else unused
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
    FIXED_POINT: tl.constexpr,  # grad_value sums integers (deterministic mode): see fixed_point_scale
    PREFETCH: tl.constexpr,  # load each step's parameters one step ahead (UNROLL 1)
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

    ACCUMULATOR = grad_value_ptr.dtype.element_ty
    if FIXED_POINT:  # integer adds give the same sum in any order: bitwise deterministic
        fixed_point_scale = tl.load(fixed_point_scale_ptr)
    else:
        fixed_point_scale = 1.0

    # One loop over every level's steps, a step GROUPS * UNROLL points of one level. With PREFETCH
    # (one point a group a step) each step loads the next one's parameters, so that their latency
    # overlaps this step's gathers and reductions instead of preceding its placement.
    STEPS: tl.constexpr = (NUM_POINTS + GROUPS * UNROLL - 1) // (GROUPS * UNROLL)  # a level's steps
    MASKED_WEIGHT: tl.constexpr = float("-inf") if SOFTMAX else 0.0  # a masked logit's softmax weight is 0
    start = b * 0  # the level's first row, in the index dtype
    if PREFETCH:  # step 0: level 0, point `group`
        tl.static_assert(UNROLL == 1, "the backward prefetches one point a group a step")
        mask = (group < NUM_POINTS) & q_ok
        next_attn = tl.load(attn_ptr + first_param + group, mask=mask, other=MASKED_WEIGHT)
        next_x = tl.load(loc_ptr + 2 * (first_param + group), mask=mask, other=0.0)
        next_y = tl.load(loc_ptr + 2 * (first_param + group) + 1, mask=mask, other=0.0)
    for step in tl.range(0, NUM_LEVELS * STEPS):
        level = step // STEPS
        h = tl.load(shapes_ptr + 2 * level).to(b.dtype)
        w = tl.load(shapes_ptr + 2 * level + 1).to(b.dtype)
        if LEVEL_STARTS:
            start = tl.load(starts_ptr + level).to(b.dtype)
        usable = level_ok(h, w, start, num_values)
        level_row = (b * num_values + start) * NUM_HEADS + m
        if PREFETCH:
            attn_now, x_now, y_now = next_attn, next_x, next_y
            following = step + 1
            next_point = (following % STEPS) * GROUPS + group
            mask = (next_point < NUM_POINTS) & q_ok & (following < NUM_LEVELS * STEPS)
            next_param = first_param + (following // STEPS) * NUM_POINTS + next_point
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
                _to_accumulator(
                    (a_top * (1.0 - fx))[:, :, None, None] * grad_out, fixed_point_scale, ACCUMULATOR, FIXED_POINT
                ),
                mask=(left & top)[:, :, None, None] & d_ok,
                sem="relaxed",
            )
            v = tl.load(value_ptr + corner + ROW, mask=(right & top)[:, :, None, None] & d_ok, other=0.0)
            dot_tr = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
            tl.atomic_add(
                grad_value_ptr + corner + ROW,
                _to_accumulator(
                    (a_top * fx)[:, :, None, None] * grad_out, fixed_point_scale, ACCUMULATOR, FIXED_POINT
                ),
                mask=(right & top)[:, :, None, None] & d_ok,
                sem="relaxed",
            )
            v = tl.load(value_ptr + below, mask=(left & bottom)[:, :, None, None] & d_ok, other=0.0)
            dot_bl = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
            tl.atomic_add(
                grad_value_ptr + below,
                _to_accumulator(
                    (a_bottom * (1.0 - fx))[:, :, None, None] * grad_out,
                    fixed_point_scale,
                    ACCUMULATOR,
                    FIXED_POINT,
                ),
                mask=(left & bottom)[:, :, None, None] & d_ok,
                sem="relaxed",
            )
            v = tl.load(value_ptr + below + ROW, mask=(right & bottom)[:, :, None, None] & d_ok, other=0.0)
            dot_br = tl.sum(tl.sum(v.to(COMPUTE) * grad_out, axis=3), axis=2)
            tl.atomic_add(
                grad_value_ptr + below + ROW,
                _to_accumulator(
                    (a_bottom * fx)[:, :, None, None] * grad_out, fixed_point_scale, ACCUMULATOR, FIXED_POINT
                ),
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
        if not LEVEL_STARTS:  # the next level's first row, after the level's last step
            start = tl.where(step % STEPS == STEPS - 1, start + h * w, start)

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


@triton.jit
def _to_accumulator(contribution, fixed_point_scale, ACCUMULATOR: tl.constexpr, FIXED_POINT: tl.constexpr):
    """A grad_value contribution in the accumulator's dtype: with FIXED_POINT the integer
    round-toward-zero(contribution * scale), else a cast."""
    if FIXED_POINT:
        return (contribution * fixed_point_scale).to(tl.int64)
    return contribution.to(ACCUMULATOR)


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
    bound = grad_output.detach().abs().amax().float() * samples_per_row
    if attention_weights is not None:
        bound = bound * attention_weights.detach().abs().amax().float()
    _, exponent = torch.frexp(bound)  # bound < 2**exponent (exponent 0 for 0, inf and NaN)
    exponent = (FIXED_POINT_BITS - exponent).clamp(min=-126, max=127)
    scale = torch.ldexp(torch.ones_like(bound), exponent)
    # Non-finite bound: NaN scale, so that the conversion back gives NaN everywhere.
    return torch.where(torch.isfinite(bound), scale, torch.nan).reshape(1)


def from_fixed_point(accumulator: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_value from its 64-bit fixed-point sums: one rounding to float32 (exact integer sums),
    an exact division by the power of two, then the value's dtype."""
    # One pass: int64 times a float32 tensor computes in float32 (the integer rounded once).
    grad_value = accumulator * scale.reciprocal()
    return grad_value if grad_value.dtype == dtype else grad_value.to(dtype)


def grad_value_buffer(
    value: torch.Tensor,
    grad_output: torch.Tensor,
    attention_weights: torch.Tensor | None,
    num_queries: int,
    num_levels: int,
    num_points: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(zeros the kernel scatters grad_value into, fixed-point scale or None). Under
    torch.use_deterministic_algorithms(True): int64 and its scale (attention_weights None: softmax
    weights, at most 1); else `grad_value_accumulator_dtype`'s dtype."""
    if torch.are_deterministic_algorithms_enabled():
        scale = fixed_point_scale(grad_output, attention_weights, num_queries * num_levels * num_points)
        return torch.zeros(value.shape, dtype=torch.int64, device=value.device), scale
    dtype = grad_value_accumulator_dtype(
        value.dtype, value.device, num_queries, value.shape[1], num_levels, num_points
    )
    return torch.zeros(value.shape, dtype=dtype, device=value.device), None


def finish_grad_value(buffer: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """grad_value in `dtype` from what `grad_value_buffer` gave and the kernel summed."""
    if scale is not None:
        return from_fixed_point(buffer, scale, dtype)
    return buffer if buffer.dtype == dtype else buffer.to(dtype)
