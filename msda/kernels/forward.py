"""The MSDA forward kernel and its launch heuristic."""

import triton
import triton.language as tl

from .sampling import corner, place_samples, sample_indices, tile_sizes


@triton.jit
def msda_forward_kernel(
    value_ptr,  # (B, S, M, D), contiguous
    shapes_ptr,  # (L, 2) int32/int64
    starts_ptr,  # (L,) int32/int64
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous
    out_ptr,  # (B, Q, M * D), contiguous
    num_queries,
    num_values,
    num_heads,
    head_dim,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_LK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE: tl.constexpr,  # tl.float32, or tl.float64 for float64 inputs
    INDEX_64: tl.constexpr,
):
    # One program: BLOCK_Q queries of one (batch, head). The flat 1-D grid has no 65535 limit
    # on B * M, and neighbouring programs share a head's value rows.
    pid = tl.program_id(0)
    if INDEX_64:  # every index below derives from pid: 64-bit where a tensor passes 2**31 elements
        pid = pid.to(tl.int64)
    num_q_blocks = tl.cdiv(num_queries, BLOCK_Q)
    bm = pid // num_q_blocks
    b = bm // num_heads
    m = bm % num_heads
    offs_q = (pid % num_q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = (offs_d < head_dim)[None, None, :]

    # float32 registers whatever the storage dtype; the sample axis is reduced once at the end.
    acc = tl.zeros([BLOCK_Q, BLOCK_LK, BLOCK_D], dtype=COMPUTE)
    for lk_start in tl.static_range(0, NUM_LEVELS * NUM_POINTS, BLOCK_LK):
        level, lk_mask, param, mask = sample_indices(
            b, m, offs_q, lk_start, num_queries, num_heads, NUM_LEVELS, NUM_POINTS, BLOCK_LK
        )
        h = tl.load(shapes_ptr + 2 * level, mask=lk_mask, other=0).to(b.dtype)[None, :]
        w = tl.load(shapes_ptr + 2 * level + 1, mask=lk_mask, other=0).to(b.dtype)[None, :]
        start = tl.load(starts_ptr + level, mask=lk_mask, other=0).to(b.dtype)[None, :]
        attn = tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE)
        # x and y interleave, so the two loads share sectors.
        x = tl.load(loc_ptr + 2 * param, mask=mask, other=0.0)
        y = tl.load(loc_ptr + 2 * param + 1, mask=mask, other=0.0)
        x0, y0, fx, fy, touches = place_samples(x, y, h, w, mask, COMPUTE)
        for DY in tl.static_range(2):
            for DX in tl.static_range(2):
                row, inside, weight, _, _ = corner(
                    x0, y0, fx, fy, h, w, start, touches, b, m, num_values, num_heads, DX, DY
                )
                # Each corner is one contiguous D-wide row: a coalesced (vectorized) gather.
                v = tl.load(
                    value_ptr + row[:, :, None] * head_dim + offs_d[None, None, :],
                    mask=inside[:, :, None] & d_mask,
                    other=0.0,
                )
                acc += (attn * weight)[:, :, None] * v.to(COMPUTE)
    out = tl.sum(acc, axis=1)

    out_row = (b * num_queries + offs_q) * num_heads + m
    tl.store(
        out_ptr + out_row[:, None] * head_dim + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_q < num_queries)[:, None] & (offs_d < head_dim)[None, :],
    )


# Launch heuristic, fixed rather than autotuned: autotuning keyed on the query count would re-tune
# at every image size, and under torch.compile a tuned config can leak across shapes. One sample
# per step, 4 warps, and as many queries as make each corner's gather 2 KB: one 16-byte vector
# load per thread (16 queries at D = 32 in float32, 32 in float16/bfloat16). That won every preset
# and dtype of the H200 sweeps in bench/NOTES.md (entries 7 and 11): a thread loading 8 or 32
# bytes instead ran up to 1.5x slower. The heuristic reads only L, K, D and the value dtype, so no
# image size changes it.
FORWARD_TILE_BYTES = 2048  # of value rows per corner per step
FORWARD_MAX_BLOCK_LK = 1  # samples per step
FORWARD_NUM_WARPS = 4


def forward_launch_config(
    num_levels: int, num_points: int, head_dim: int, value_element_size: int, float64: bool = False
) -> dict[str, int]:
    if float64:
        # gradcheck's dtype, not a fast path: one query and one sample per step. triton 3.6
        # failed to compile 8-byte tiles of exactly 16 sample rows (a layout pass on the sample
        # mask): over 2 or more queries at first, then over one query with int32 spatial shapes.
        # One row per step compiles at every case of scripts/compile_check.py.
        block_q, block_lk, block_d = tile_sizes(num_levels, num_points, head_dim, 1, max_block_lk=1)
    else:
        block_q, block_lk, block_d = tile_sizes(
            num_levels, num_points, head_dim, FORWARD_TILE_BYTES // value_element_size, FORWARD_MAX_BLOCK_LK
        )
    return dict(BLOCK_Q=block_q, BLOCK_LK=block_lk, BLOCK_D=block_d, num_warps=FORWARD_NUM_WARPS)
