"""The MSDA backward kernel (all three gradients in one pass), its launch heuristic and the
rule that picks the dtype `grad_value` is accumulated in."""

import torch
import triton
import triton.language as tl

from .sampling import corner, place_samples, sample_indices, tile_sizes


@triton.jit
def msda_backward_kernel(
    grad_out_ptr,  # (B, Q, M * D), any strides (an expanded grad_output has stride 0)
    grad_out_stride_b,
    grad_out_stride_q,
    grad_out_stride_c,
    value_ptr,  # (B, S, M, D), contiguous
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,)
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous
    grad_value_ptr,  # (B, S, M, D) zeros: value's dtype or the float32 accumulator
    grad_loc_ptr,  # like loc
    grad_attn_ptr,  # like attn
    num_queries,
    num_values,
    num_heads,
    head_dim,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_LK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    pid = tl.program_id(0)
    if INDEX_64:  # every index below derives from pid: 64-bit where a tensor passes 2**31 elements
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    bm = pid // num_q_blocks
    b = bm // num_heads
    m = bm % num_heads
    offs_q = (pid % num_q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = offs_q < num_queries
    d_mask = offs_d < head_dim

    level, lk_mask, param, mask = sample_indices(
        b, m, offs_q, 0, num_queries, num_heads, NUM_LEVELS, NUM_POINTS, BLOCK_LK
    )
    h = tl.load(shapes_ptr + 2 * level, mask=lk_mask, other=0).to(b.dtype)[None, :]
    w = tl.load(shapes_ptr + 2 * level + 1, mask=lk_mask, other=0).to(b.dtype)[None, :]
    start = tl.load(starts_ptr + level, mask=lk_mask, other=0).to(b.dtype)[None, :]
    attn = tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE)
    # x and y interleave, so the two loads share sectors.
    x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
    y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
    x0, y0, fx, fy, touches = place_samples(x, y, h, w, mask, COMPUTE)
    grad_out = tl.load(
        grad_out_ptr
        + b * grad_out_stride_b
        + offs_q[:, None] * grad_out_stride_q
        + (m * head_dim + offs_d[None, :]) * grad_out_stride_c,
        mask=q_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(COMPUTE)[:, None, :]

    grad_attn = tl.zeros([BLOCK_Q, BLOCK_LK], dtype=COMPUTE)
    grad_x = tl.zeros([BLOCK_Q, BLOCK_LK], dtype=COMPUTE)
    grad_y = tl.zeros([BLOCK_Q, BLOCK_LK], dtype=COMPUTE)
    for DY in tl.static_range(2):
        for DX in tl.static_range(2):
            row, inside, weight, dweight_dx, dweight_dy = corner(
                x0, y0, fx, fy, h, w, start, touches, b, m, num_values, num_heads, DX, DY
            )
            offsets = row[:, :, None] * head_dim + offs_d[None, None, :]
            row_mask = inside[:, :, None] & d_mask[None, None, :]
            v = tl.load(value_ptr + offsets, mask=row_mask, other=0.0).to(COMPUTE)
            # The location and attention gradients need only <grad_out, corner value>,
            # so each corner's D channels reduce to one number right away.
            dot = tl.sum(v * grad_out, axis=2)
            grad_attn += weight * dot
            grad_x += dweight_dx * dot
            grad_y += dweight_dy * dot
            # Many queries can hit one value row, so grad_value is a scatter. Relaxed atomics:
            # only the final sum matters, no ordering with other memory.
            tl.atomic_add(
                grad_value_ptr + offsets,
                ((attn * weight)[:, :, None] * grad_out).to(grad_value_ptr.dtype.element_ty),
                mask=row_mask,
                sem="relaxed",
            )

    # Chain rule through x_im = x * W - 0.5 and y_im = y * H - 0.5.
    grad_x = grad_x * attn * w.to(COMPUTE)
    grad_y = grad_y * attn * h.to(COMPUTE)
    tl.store(grad_loc_ptr + 2 * param, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_loc_ptr + 2 * param + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_attn_ptr + param, grad_attn.to(grad_attn_ptr.dtype.element_ty), mask=mask)


# Launch heuristic, fixed rather than autotuned (see forward.py): all L*K samples of 2 queries
# at D = 32 per program (1024 elements per corner), 4 warps. In the H200 sweep of bench/NOTES.md
# it was within 6% of the best of 512 to 2048 elements and 2 or 4 warps in every cell.
BACKWARD_TILE_ELEMENTS = 1024
BACKWARD_NUM_WARPS = 4


def backward_launch_config(num_levels: int, num_points: int, head_dim: int) -> dict[str, int]:
    block_q, block_lk, block_d = tile_sizes(num_levels, num_points, head_dim, BACKWARD_TILE_ELEMENTS)
    return dict(BLOCK_Q=block_q, BLOCK_LK=block_lk, BLOCK_D=block_d, num_warps=BACKWARD_NUM_WARPS)


# Half-precision atomics round at every add. That costs nothing where few samples land on each
# value row (the decoder: Q*L*K = 4,800 samples over S = 22,223 rows per (batch, head)) and
# misses SPEC.md's bounds where many do (the encoder: 16 samples a row on average, hundreds on
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
