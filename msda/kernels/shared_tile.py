"""The last level's grad_value summed per program in shared memory (bench/NOTES.md entries 49, 50).

The float32 encoder backward is bound by its L2 reductions (entries 33, 46): the coarsest level's
corner rows, a quarter of them, cost 211 us of the preset's ~870 because ~330 samples land on each
of its 273 pixels a head. Summed on the SM first, each program adds a pixel's row once: the
backward kernel leaves that level's adds out (TILE_PIXELS) and this kernel sums them, 822-831 /
791-800 us in all at the preset on an H200 (uniform / `local`).

Triton has no shared memory a kernel can index; Gluon (triton.experimental, 3.6) allocates it,
and inline PTX reads and writes it (Gluon's own loads and stores of a row put a barrier around
each). Gluon kernels do not run in Triton's interpreter, and Inductor cannot compile one passed
through `triton_op` / `wrap_triton` (torch 2.11: "name 'gl' is not defined"): a traced backward
calls it through the custom op msda::add_shared_tile_ (ops.py), an eager one directly; only
where `launch.shared_tile_applies` says so (`launch.SHARED_TILE` on, CUDA, not the interpreter).

A program (4 warps) takes QB queries of one (batch, head). Warp w owns channels 8w..8w+7 of the
tile, a lane (c, j) of it corner c and channel 8w + j: a sample's four corners are four pixels,
so no two lanes of the program touch one address at once (corners outside the level go to one
of four rows past it, DUMMY + c, whose sums are thrown away), and no atomics. A round takes 32
samples (8 queries x 4 points): each warp places them, a sample a lane, and stages each corner's
row and weight in shared memory (its own staging area); then for each sample in turn every lane
adds weight * grad_out into its element of the tile (ld.shared, add, st.shared; a warp barrier
between two adds). Then the tile's rows are added into grad_value, one atomic row each. Rows:
[0, area) the level, DUMMY..DUMMY + 3 for corners outside, STAGE.. the staging areas. A level of
more than DUMMY pixels is left to the backward kernel (which adds it where TILE_PIXELS says it
does not fit): the choice is made on the device, where the sizes are.
The unrolled lines below are what a loop over 32 records would be: the JIT has no register arrays.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _asm_u32(asm: gl.constexpr, like):
    return gl.inline_asm_elementwise(asm, "=r,r", [like], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _st2(address, a, b):
    return gl.inline_asm_elementwise("st.shared.v2.b32 [$1], {$2, $3}; mov.b32 $0, 0;", "=r,r,r,f",
                                     [address, a, b], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ld_record(address):
    return gl.inline_asm_elementwise("ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r", [address],
                                     dtype=(gl.int32, gl.float32), is_pure=False, pack=1)


@gluon.jit
def _rmw(address, value):
    # Consecutive adds of one warp reach one row from different lanes (a pixel that is corner 0 of
    # one sample and corner 1 of the next): the warp barrier orders them as the PTX memory model
    # asks. ptxas lowers it to a NOP in this converged warp (sm_90 SASS: 32 NOPs a round, nothing else).
    return gl.inline_asm_elementwise(
        "{ .reg .f32 t; bar.warp.sync -1; ld.shared.f32 t, [$1]; add.f32 t, t, $2; st.shared.f32 [$1], t; "
        "mov.b32 $0, 0; }", "=r,r,f", [address, value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _warp_sync(like):
    return gl.inline_asm_elementwise("bar.warp.sync -1; mov.b32 $0, 0;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _corner(xi, yi, w, h, weight, DUMMY: gl.constexpr, C: gl.constexpr):
    """(the row's byte offset | its swizzle's bits 5-6, the weight) of corner C"""
    inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
    offset = (yi * w + xi) * 128 + (((yi & 1) * 2 + (xi & 1)) * 32)
    return gl.where(inside, offset, (DUMMY + C) * 128 + C * 32), gl.where(inside, weight, 0.0)


@gluon.jit
def msda_shared_tile_kernel(
    grad_out_ptr,  # (B, Q, M * D), channels contiguous
    grad_out_stride_b,
    grad_out_stride_q,
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    loc_ptr,  # (B, Q, M, L, K, 2)
    attn_ptr,  # (B, Q, M, L, K)
    grad_value_ptr,  # (B, S, M, D) float32
    num_queries,
    num_values,
    LVL: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_LEVELS: gl.constexpr,
    NUM_POINTS: gl.constexpr,
    QB: gl.constexpr,
    DUMMY: gl.constexpr,  # the first of four rows past the level's: a corner c outside it adds to DUMMY + c
    STAGE: gl.constexpr,  # the first row of the staging areas (1 KB a warp)
    ROWS: gl.constexpr,
    LEVEL_STARTS: gl.constexpr,  # False: the level starts at num_values - its size (LVL the last level)
):
    gl.static_assert(HEAD_DIM == 32)
    gl.static_assert(NUM_POINTS == 4)
    NW: gl.constexpr = 4
    gl.static_assert(DUMMY + 4 <= STAGE)
    gl.static_assert(STAGE + NW * 8 <= ROWS)  # a warp's staging area: 32 samples x 4 records x 8 bytes
    gl.static_assert(STAGE % 32 == 0 and ROWS % 32 == 0)  # the zeroing's blocks of 32 rows
    # A pixel (y, x)'s row holds channel c at c ^ 8 * ((y % 2) * 2 + x % 2): a sample's four corner
    # rows, which a warp's lanes read at once (8 channels each), fall in four different 8-bank groups.
    ROW_BYTES: gl.constexpr = HEAD_DIM * 4
    # Blocks of 32 rows, row-major: the tile is read and written through inline PTX at global_smem
    # (this allocation is the kernel's only one, at offset 0), row r at r * ROW_BYTES; the zeroing
    # below is Gluon's store (which keeps the allocation).
    smem = gl.allocate_shared_memory(gl.float32, [ROWS // 32, 32, HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # Where the level has more pixels than the tile holds, this kernel does nothing (and the
    # backward kernel adds that level itself: it masks the level's adds only where it fits).
    h = gl.load(shapes_ptr + 2 * LVL).to(gl.int32)
    w = gl.load(shapes_ptr + 2 * LVL + 1).to(gl.int32)
    area = h * w
    if LEVEL_STARTS:
        start = gl.load(starts_ptr + LVL).to(gl.int32)
    else:
        start = num_values - area
    if area <= DUMMY:
        # [32, 32] tiles: the zeroing and the flush, a row of 32 channels over 8 lanes of 4 channels.
        tile32: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        t_rows = gl.arange(0, 32, gl.SliceLayout(1, tile32))[:, None]
        t_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, tile32))[None, :]
        smem_base = _asm_u32("mov.b32 $0, global_smem;", t_rows * 0)
        for z in gl.static_range(STAGE // 32):  # the level's rows and the four outside
            smem.index(z).store(gl.zeros([32, HEAD_DIM], gl.float32, tile32))
        gl.thread_barrier()

        pid = gl.program_id(0)
        num_q_blocks = (num_queries + QB - 1) // QB
        q_block = pid % num_q_blocks
        bm = pid // num_q_blocks
        b = bm // NUM_HEADS
        m = bm % NUM_HEADS
        hf = h.to(gl.float32)
        wf = w.to(gl.float32)
        LK: gl.constexpr = NUM_LEVELS * NUM_POINTS

        # Placement: a sample a lane (every warp places the same 32).
        lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        lane = gl.arange(0, 32, lane_layout)
        tid = _asm_u32("mov.u32 $0, %tid.x;", lane * 0)
        # This lane's sample's four records (row offset, weight) in its warp's staging area.
        stage = _asm_u32("mov.b32 $0, global_smem;", lane * 0) + STAGE * ROW_BYTES + (tid // 32) * 1024 + lane * 32
        # The add: [4 corners, 32 channels], a lane (corner, channel) of its warp's 8.
        add_layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, NW], [1, 0])
        corner = gl.arange(0, 4, gl.SliceLayout(1, add_layout))[:, None]
        ch = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, add_layout))[None, :]
        a_tid = _asm_u32("mov.u32 $0, %tid.x;", corner * 0 + ch * 0)
        a_base = _asm_u32("mov.b32 $0, global_smem;", corner * 0 + ch * 0)
        record = a_base + STAGE * ROW_BYTES + (a_tid // 32) * 1024 + corner * 8  # + sample * 32
        ch4 = ch * 4
        grad_row = grad_out_ptr + b * grad_out_stride_b + m * HEAD_DIM + ch  # + q * stride_q

        q_end = gl.minimum(q_block * QB + QB, num_queries)
        q = q_block * QB + lane // 4
        ok = q < q_end
        param = ((b * num_queries + q) * NUM_HEADS + m) * LK + LVL * NUM_POINTS + lane % 4
        x = gl.load(loc_ptr + 2 * param, mask=ok, other=-2.0)
        y = gl.load(loc_ptr + 2 * param + 1, mask=ok, other=-2.0)
        a = gl.load(attn_ptr + param, mask=ok, other=0.0)
        g0 = gl.load(grad_row + gl.minimum(q_block * QB + 0, num_queries - 1) * grad_out_stride_q)
        g1 = gl.load(grad_row + gl.minimum(q_block * QB + 1, num_queries - 1) * grad_out_stride_q)
        g2 = gl.load(grad_row + gl.minimum(q_block * QB + 2, num_queries - 1) * grad_out_stride_q)
        g3 = gl.load(grad_row + gl.minimum(q_block * QB + 3, num_queries - 1) * grad_out_stride_q)
        g4 = gl.load(grad_row + gl.minimum(q_block * QB + 4, num_queries - 1) * grad_out_stride_q)
        g5 = gl.load(grad_row + gl.minimum(q_block * QB + 5, num_queries - 1) * grad_out_stride_q)
        g6 = gl.load(grad_row + gl.minimum(q_block * QB + 6, num_queries - 1) * grad_out_stride_q)
        g7 = gl.load(grad_row + gl.minimum(q_block * QB + 7, num_queries - 1) * grad_out_stride_q)
        for first in range(q_block * QB, q_end, 8):
            c0 = g0
            c1 = g1
            c2 = g2
            c3 = g3
            c4 = g4
            c5 = g5
            c6 = g6
            c7 = g7
            cx = x
            cy = y
            ca = a
            q = first + 8 + lane // 4
            ok = q < q_end
            param = ((b * num_queries + q) * NUM_HEADS + m) * LK + LVL * NUM_POINTS + lane % 4
            x = gl.load(loc_ptr + 2 * param, mask=ok, other=-2.0)
            y = gl.load(loc_ptr + 2 * param + 1, mask=ok, other=-2.0)
            a = gl.load(attn_ptr + param, mask=ok, other=0.0)
            g0 = gl.load(grad_row + gl.minimum(first + 8 + 0, num_queries - 1) * grad_out_stride_q)
            g1 = gl.load(grad_row + gl.minimum(first + 8 + 1, num_queries - 1) * grad_out_stride_q)
            g2 = gl.load(grad_row + gl.minimum(first + 8 + 2, num_queries - 1) * grad_out_stride_q)
            g3 = gl.load(grad_row + gl.minimum(first + 8 + 3, num_queries - 1) * grad_out_stride_q)
            g4 = gl.load(grad_row + gl.minimum(first + 8 + 4, num_queries - 1) * grad_out_stride_q)
            g5 = gl.load(grad_row + gl.minimum(first + 8 + 5, num_queries - 1) * grad_out_stride_q)
            g6 = gl.load(grad_row + gl.minimum(first + 8 + 6, num_queries - 1) * grad_out_stride_q)
            g7 = gl.load(grad_row + gl.minimum(first + 8 + 7, num_queries - 1) * grad_out_stride_q)
            x_im = cx * wf - 0.5
            y_im = cy * hf - 0.5
            x0f = gl.floor(x_im)
            y0f = gl.floor(y_im)
            fx = x_im - x0f
            fy = y_im - y0f
            inside = (x_im > -1.0) & (x_im < wf) & (y_im > -1.0) & (y_im < hf)
            ca = gl.where(inside, ca, 0.0)
            x0 = gl.where(inside, x0f, 0.0).to(gl.int32)
            y0 = gl.where(inside, y0f, 0.0).to(gl.int32)
            r0, w0 = _corner(x0, y0, w, h, ca * (1.0 - fy) * (1.0 - fx), DUMMY, 0)
            r1, w1 = _corner(x0 + 1, y0, w, h, ca * (1.0 - fy) * fx, DUMMY, 1)
            r2, w2 = _corner(x0, y0 + 1, w, h, ca * fy * (1.0 - fx), DUMMY, 2)
            r3, w3 = _corner(x0 + 1, y0 + 1, w, h, ca * fy * fx, DUMMY, 3)
            _warp_sync(lane)  # the previous round's records all read
            _st2(stage, r0, w0)
            _st2(stage + 8, r1, w1)
            _st2(stage + 16, r2, w2)
            _st2(stage + 24, r3, w3)
            _warp_sync(lane)
            row0, wt0 = _ld_record(record + 0)
            row1, wt1 = _ld_record(record + 32)
            row2, wt2 = _ld_record(record + 64)
            row3, wt3 = _ld_record(record + 96)
            row4, wt4 = _ld_record(record + 128)
            row5, wt5 = _ld_record(record + 160)
            row6, wt6 = _ld_record(record + 192)
            row7, wt7 = _ld_record(record + 224)
            row8, wt8 = _ld_record(record + 256)
            row9, wt9 = _ld_record(record + 288)
            row10, wt10 = _ld_record(record + 320)
            row11, wt11 = _ld_record(record + 352)
            row12, wt12 = _ld_record(record + 384)
            row13, wt13 = _ld_record(record + 416)
            row14, wt14 = _ld_record(record + 448)
            row15, wt15 = _ld_record(record + 480)
            row16, wt16 = _ld_record(record + 512)
            row17, wt17 = _ld_record(record + 544)
            row18, wt18 = _ld_record(record + 576)
            row19, wt19 = _ld_record(record + 608)
            row20, wt20 = _ld_record(record + 640)
            row21, wt21 = _ld_record(record + 672)
            row22, wt22 = _ld_record(record + 704)
            row23, wt23 = _ld_record(record + 736)
            row24, wt24 = _ld_record(record + 768)
            row25, wt25 = _ld_record(record + 800)
            row26, wt26 = _ld_record(record + 832)
            row27, wt27 = _ld_record(record + 864)
            row28, wt28 = _ld_record(record + 896)
            row29, wt29 = _ld_record(record + 928)
            row30, wt30 = _ld_record(record + 960)
            row31, wt31 = _ld_record(record + 992)
            _rmw(a_base + (row0 & -128) + (ch4 ^ (row0 & 127)), wt0 * c0)
            _rmw(a_base + (row1 & -128) + (ch4 ^ (row1 & 127)), wt1 * c0)
            _rmw(a_base + (row2 & -128) + (ch4 ^ (row2 & 127)), wt2 * c0)
            _rmw(a_base + (row3 & -128) + (ch4 ^ (row3 & 127)), wt3 * c0)
            _rmw(a_base + (row4 & -128) + (ch4 ^ (row4 & 127)), wt4 * c1)
            _rmw(a_base + (row5 & -128) + (ch4 ^ (row5 & 127)), wt5 * c1)
            _rmw(a_base + (row6 & -128) + (ch4 ^ (row6 & 127)), wt6 * c1)
            _rmw(a_base + (row7 & -128) + (ch4 ^ (row7 & 127)), wt7 * c1)
            _rmw(a_base + (row8 & -128) + (ch4 ^ (row8 & 127)), wt8 * c2)
            _rmw(a_base + (row9 & -128) + (ch4 ^ (row9 & 127)), wt9 * c2)
            _rmw(a_base + (row10 & -128) + (ch4 ^ (row10 & 127)), wt10 * c2)
            _rmw(a_base + (row11 & -128) + (ch4 ^ (row11 & 127)), wt11 * c2)
            _rmw(a_base + (row12 & -128) + (ch4 ^ (row12 & 127)), wt12 * c3)
            _rmw(a_base + (row13 & -128) + (ch4 ^ (row13 & 127)), wt13 * c3)
            _rmw(a_base + (row14 & -128) + (ch4 ^ (row14 & 127)), wt14 * c3)
            _rmw(a_base + (row15 & -128) + (ch4 ^ (row15 & 127)), wt15 * c3)
            _rmw(a_base + (row16 & -128) + (ch4 ^ (row16 & 127)), wt16 * c4)
            _rmw(a_base + (row17 & -128) + (ch4 ^ (row17 & 127)), wt17 * c4)
            _rmw(a_base + (row18 & -128) + (ch4 ^ (row18 & 127)), wt18 * c4)
            _rmw(a_base + (row19 & -128) + (ch4 ^ (row19 & 127)), wt19 * c4)
            _rmw(a_base + (row20 & -128) + (ch4 ^ (row20 & 127)), wt20 * c5)
            _rmw(a_base + (row21 & -128) + (ch4 ^ (row21 & 127)), wt21 * c5)
            _rmw(a_base + (row22 & -128) + (ch4 ^ (row22 & 127)), wt22 * c5)
            _rmw(a_base + (row23 & -128) + (ch4 ^ (row23 & 127)), wt23 * c5)
            _rmw(a_base + (row24 & -128) + (ch4 ^ (row24 & 127)), wt24 * c6)
            _rmw(a_base + (row25 & -128) + (ch4 ^ (row25 & 127)), wt25 * c6)
            _rmw(a_base + (row26 & -128) + (ch4 ^ (row26 & 127)), wt26 * c6)
            _rmw(a_base + (row27 & -128) + (ch4 ^ (row27 & 127)), wt27 * c6)
            _rmw(a_base + (row28 & -128) + (ch4 ^ (row28 & 127)), wt28 * c7)
            _rmw(a_base + (row29 & -128) + (ch4 ^ (row29 & 127)), wt29 * c7)
            _rmw(a_base + (row30 & -128) + (ch4 ^ (row30 & 127)), wt30 * c7)
            _rmw(a_base + (row31 & -128) + (ch4 ^ (row31 & 127)), wt31 * c7)

        gl.thread_barrier()
        target = grad_value_ptr + ((b * num_values + start) * NUM_HEADS + m) * HEAD_DIM + t_cols
        for f0 in gl.static_range(0, ROWS, 32):
            if f0 < area:
                rows = f0 + t_rows
                swizzle = (((rows // w) & 1) * 2 + ((rows % w) & 1)) * 32
                v = gl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r",
                                              [smem_base + rows * ROW_BYTES + ((t_cols * 4) ^ swizzle)],
                                              dtype=gl.float32, is_pure=False, pack=1)
                gl.atomic_add(target + rows * (NUM_HEADS * HEAD_DIM), v, mask=(rows < area) & (t_cols < HEAD_DIM),
                              sem="relaxed")
