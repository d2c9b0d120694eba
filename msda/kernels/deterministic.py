"""The deterministic mode's grad_value without atomic adds on it (bench/NOTES.md entries 35-43).

Under torch.use_deterministic_algorithms(True) grad_value must come out the same, bit for bit, in
every run. Float atomics add in no fixed order; integer sums are the same in any order, but PTX
has no vector integer atomic (one 64-bit atomic a channel, four times the float32 path's
instructions). Instead each value row gathers its own contributions from lists of samples,
and sums them in one of two ways (launch.list_rule):

- an encoder's (every pixel a query: lists of hundreds of entries on its coarse levels) in
  64-bit fixed point (backward.py: `fixed_point_scale`), integers: the same sum in any order;
- a decoder's (short lists, most of one entry or none) in float32, in the order of its lists
  sorted first (SORTED_SUMS): a third faster than the fixed point (bench/NOTES.md entries 42-43).

1. The backward kernel (COUNT_STRIDE) adds 1 to an int32 count per list for each sample that
   touches its level. A sample is listed once, under its top-left corner's row (batch, head,
   pixel; -1 coordinates, of samples straddling the top or left border, clamped to 0 and
   flagged in the entry's two low bits), so its four corners cost one count, not four. Integer
   adds: the counts are the same in any order. The count before a sample's own is its rank in
   the list: the kernel stores it at the sample's index times 4 in the weights' array. A
   cumulative sum (torch.cumsum) gives each list's end in one array of all lists.
2. `msda_sample_lists_kernel` gives each sample its slot, the list's start plus its rank, and
   stores the sample's index times 4 plus the flags there; it also writes every corner's
   bilinear weight times the attention weight (the backward kernel's arithmetic, bit for bit)
   to a dense array at the sample's index times 4 plus the corner, over the rank. The slots'
   order within a list varies run to run (the atomics' order); with SLOT_LISTS (sorted lists)
   it writes each slot's list too, for the sort. It places each sample as the backward kernel
   did when it counted (sampling.place_sample, the same masks): one sample counted and not
   listed, or the reverse, would leave a slot unwritten or write another's.
3. With SORTED_SUMS, `msda_sort_lists_kernel` writes each list in ascending order (into a copy):
   the order no longer depends on the slots'. A thread a slot counts the entries of its list
   below its own, which is n steps for a list of n: a decoder's take 2.5 us at the preset (an
   encoder's, hundreds long on its coarse levels, take hundreds of steps a slot).
4. `msda_gather_grad_value_kernel` takes ROWS rows (consecutive pixels of one head) a program.
   A row at (y, x) is the top-left corner of the samples listed under it, the top-right one of
   those under (y, x - 1), the bottom corners of those under (y - 1, x) and (y - 1, x - 1):
   lists that sit side by side in pairs, (x - 1, x), so two runs of entries a row. It walks them
   side by side, ENTRIES entries a step (independent loads, in flight together; encoders), or
   JOINED, one after the other, an entry a step (decoders): each entry's corner weight
   times its query's grad_output row, rounded to fixed point, summed as integers in registers:
   the same sum in any order, so the slot order does not matter, and the result is the atomic
   fixed-point path's to the bit; with SORTED_SUMS, added in float32 in the sorted lists'
   order. It writes grad_value once, in the value's dtype: nothing to zero.

Without SORTED_SUMS, `msda_fixed_point_scale_kernel` computes the fixed point's scale
(`backward.fixed_point_scale`) first, in one launch.

The backward kernel computes the other two gradients as usual (GRAD_VALUE=False).
"""

import triton
import triton.language as tl

from .sampling import finite_or_nan, level_ok, place_sample

CLAMPED_X = tl.constexpr(1)  # entry flag: the sample's x0 is -1, listed under x = 0
CLAMPED_Y = tl.constexpr(2)  # entry flag: its y0 is -1, listed under y = 0


@triton.jit
def rank_as_float(rank, FLOAT: tl.constexpr):
    """A sample's rank in its list in the bits of a FLOAT (float32; float64 through int64), as the
    backward kernel leaves it in the corner weights' array; `rank_from_float` reads it back."""
    if FLOAT == tl.float64:
        return rank.to(tl.int64).to(tl.float64, bitcast=True)
    return rank.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def rank_from_float(bits):
    return bits.to(tl.int64 if bits.dtype == tl.float64 else tl.int32, bitcast=True)


@triton.jit(do_not_specialize=["num_queries", "num_values"])
def msda_sample_lists_kernel(
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    loc_ptr,  # (B, Q, M, L, K, 2), contiguous
    attn_ptr,  # (B, Q, M, L, K), contiguous: the weights
    ends_ptr,  # (B * M * S,) the cumulative sum of the backward kernel's counts (int32, or int64 if INDEX_64)
    entries_ptr,  # (B * Q * M * L * K,) int32 or int64: the lists
    slot_lists_ptr,  # like entries: each slot's list, written if SLOT_LISTS
    weights_ptr,  # (B * Q * M * L * K * 4,) in COMPUTE: each corner's weight; read first: each listed sample's rank
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
    SLOT_LISTS: tl.constexpr,  # write each slot's list too, for `msda_sort_lists_kernel`
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
    first_list = bm * num_values  # this batch and head's lists, one a pixel
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
        # A sample touching the level has x0 in [-1, w - 1] and y0 in [-1, h - 1] (place_sample):
        # then its left or its right corner is inside. The backward kernel counted it so, and
        # left its rank in the list where its corner weights go: read before they are written
        # (by other threads of this program: hence the barrier).
        listed = left | right
        rank = rank_from_float(tl.load(weights_ptr + 4 * param, mask=listed, other=0.0))
        list_id = first_list + start + tl.maximum(y0, 0) * w + tl.maximum(x0, 0)
        slot = tl.load(ends_ptr + list_id - 1, mask=listed & (list_id > 0), other=0) + rank
        tl.debug_barrier()
        # The backward kernel's products, in its order: the same bits.
        attn = finite_or_nan(tl.load(attn_ptr + param, mask=mask, other=0.0).to(COMPUTE))
        a_top = attn * (1.0 - fy)
        a_bottom = attn * fy
        # Dense, at each corner's index: coalesced stores here (written at the slots, beside
        # the entries, the fill ran 12-19% longer and the gather 8% shorter on the H200).
        # A sample's four in one thread: one 16-byte store, not four strided ones.
        upper = tl.join(a_top * (1.0 - fx), a_top * fx)
        lower = tl.join(a_bottom * (1.0 - fx), a_bottom * fx)
        corners = tl.reshape(tl.join(upper, lower).permute(0, 1, 3, 2), [BLOCK_Q, BLOCK_K, 4])
        corner = param[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        tl.store(weights_ptr + corner, corners, mask=mask[:, :, None])
        flags = tl.where(x0 < 0, CLAMPED_X, 0) + tl.where(y0 < 0, CLAMPED_Y, 0)
        entry = param * 4 + flags
        tl.store(entries_ptr + slot, entry.to(entries_ptr.dtype.element_ty), mask=listed)
        if SLOT_LISTS:  # scattered, as the entries (the kernel takes 2 us more at the decoder preset)
            tl.store(slot_lists_ptr + slot, list_id.to(slot_lists_ptr.dtype.element_ty), mask=listed)
        if not LEVEL_STARTS:
            start += h * w


@triton.jit(do_not_specialize=["num_lists"])
def msda_sort_lists_kernel(
    ends_ptr,  # (num_lists,) where each list ends (`msda_sample_lists_kernel`)
    entries_ptr,  # the lists, in the order their slots were taken
    sorted_ptr,  # like entries: written, each list in ascending order
    slot_lists_ptr,  # like entries: each slot's list (`msda_sample_lists_kernel`, SLOT_LISTS)
    num_lists,
    BLOCK: tl.constexpr,  # slots a program
    AHEAD: tl.constexpr,  # entries of its list a slot compares with a step: loads in flight together
    INDEX_64: tl.constexpr,
):
    """Each list in ascending order, so that the gather's float32 sums add its entries in an order
    that does not depend on the order the slots were taken in (SORTED_SUMS). A list holds each
    entry once (a sample is listed under one pixel), so an entry's place is the number of its
    list's entries below it. A thread a slot, each comparing its entry with its list's: the
    longest list a program takes n / AHEAD steps. The slots run list by list, so a program's
    lists are of one level, and only the coarse levels' programs take long (2.5 us at the
    decoder preset; a thread a list, placing its entries a chunk at a time, took 10.4: n * n / 16
    dependent loads on the coarse levels' lists; a thread a sample, its list stored at the
    sample's index, 6.1: a program's samples span every level, so each waits on the coarsest;
    bench/NOTES.md entry 43)."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    slot = pid * BLOCK + tl.arange(0, BLOCK)
    mine = slot < tl.load(ends_ptr + num_lists - 1)  # the slots taken (samples outside every level have none)
    its_list = tl.load(slot_lists_ptr + slot, mask=mine, other=0)
    entry = tl.load(entries_ptr + slot, mask=mine, other=0)
    end = tl.load(ends_ptr + its_list, mask=mine, other=0)
    start = tl.load(ends_ptr + its_list - 1, mask=mine & (its_list > 0), other=0)
    length = end - start
    longest = tl.max(length, axis=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    compared = longest * 0
    while compared < longest:  # (bounds from memory: while loops, which the interpreter runs)
        for ahead in tl.static_range(AHEAD):
            theirs = mine & (compared + ahead < length)
            other = tl.load(entries_ptr + start + compared + ahead, mask=theirs, other=0)
            rank += ((other < entry) & theirs).to(tl.int32)
        compared += AHEAD
    tl.store(sorted_ptr + start + rank, entry, mask=mine)


@triton.jit(
    do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "num_values", "num_lists"]
)
def msda_gather_grad_value_kernel(
    grad_out_ptr,  # (B, Q, M * D), channels contiguous
    grad_out_stride_b,
    grad_out_stride_q,
    shapes_ptr,  # (L, 2)
    starts_ptr,  # (L,), read if LEVEL_STARTS
    ends_ptr,  # (B * M * S,) int32 (int64 if INDEX_64): where each list ends (`msda_sample_lists_kernel`)
    entries_ptr,  # the lists
    weights_ptr,  # each corner's weight, at its sample's index times 4 plus the corner
    # float32 (2,): the fixed-point scale 2**e and 2**-e (`msda_fixed_point_scale_kernel`); unread with SORTED_SUMS
    scales_ptr,
    grad_value_ptr,  # (B, S, M, D) in the value's dtype: written whole
    num_queries,
    num_values,
    num_lists,  # B * M * S: one a row
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program
    # entries of each of a row's two runs a step, unrolled: their loads in flight together (not JOINED)
    ENTRIES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDEX_64: tl.constexpr,
    LEVEL_STARTS: tl.constexpr,  # False: sum the level sizes
    BATCHES_FOLLOW: tl.constexpr,  # grad_out_stride_b == num_queries * grad_out_stride_q: no division
    BLOCK_L: tl.constexpr,  # NUM_LEVELS's next power of two
    ROWS_ALIGNED: tl.constexpr,  # grad_out's rows start at multiples of 16 elements (both strides are)
    JOINED: tl.constexpr,  # a row's two runs one after the other, one entry a step, loaded a step ahead
    SORTED_SUMS: tl.constexpr,  # lists in ascending order (`msda_sort_lists_kernel`): float32 sums in their order
):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    # A program takes ROWS consecutive pixels of one batch and head (its lists' order). The last
    # pixels first, of every batch and head: the coarse levels, at the end, have the longest
    # lists, and must not be left for the end of the launch (the encoder's gather took 1,111 us
    # in head order against 700 for the per-corner lists before; bench/NOTES.md entry 37).
    num_heads_batches = num_lists // num_values
    first_pixel = (tl.cdiv(num_values, ROWS) - 1 - pid // num_heads_batches) * ROWS
    bm = pid % num_heads_batches
    pixel = first_pixel + tl.arange(0, ROWS)  # [ROWS]
    row_ok = pixel < num_values
    row = bm * num_values + pixel  # the lists this program sums: one a row
    last_pixel = tl.minimum(first_pixel + ROWS, num_values) - 1
    channel = tl.arange(0, BLOCK_D)[None, :]
    d_ok = channel < HEAD_DIM
    head_channel = (bm % NUM_HEADS) * HEAD_DIM + channel  # [1, BLOCK_D]
    if SORTED_SUMS:  # the same sum in the same order every run: float32 will do
        scale = 1.0
        total = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    else:  # any order: 64-bit fixed point
        scale = tl.load(scales_ptr)
        total = tl.zeros([ROWS, BLOCK_D], dtype=tl.int64)
    # The levels' shapes and starts in one round trip, and which levels the program's pixels
    # meet: a loop that loaded them level by level waited on each load in turn.
    levels = tl.arange(0, BLOCK_L)
    level_exists = levels < NUM_LEVELS
    heights = tl.load(shapes_ptr + 2 * levels, mask=level_exists, other=0).to(pid.dtype)
    widths = tl.load(shapes_ptr + 2 * levels + 1, mask=level_exists, other=0).to(pid.dtype)
    if LEVEL_STARTS:
        starts = tl.load(starts_ptr + levels, mask=level_exists, other=0).to(pid.dtype)
    else:
        starts = tl.cumsum(heights * widths, axis=0) - heights * widths
    stops = starts + heights * widths
    met = level_exists & level_ok(heights, widths, starts, num_values) & (first_pixel < stops) & (last_pixel >= starts)
    # Every level that holds a row: one or two a program, unless level_start_index makes levels overlap.
    for level in tl.range(NUM_LEVELS):
        this = levels == level
        if tl.sum(tl.where(this & met, 1, 0), axis=0) > 0:
            w = tl.sum(tl.where(this, widths, 0), axis=0)
            start = tl.sum(tl.where(this, starts, 0), axis=0)
            stop = tl.sum(tl.where(this, stops, 0), axis=0)
            in_level = row_ok & (pixel >= start) & (pixel < stop)
            y = (pixel - start) // tl.maximum(w, 1)
            x = pixel - start - y * w
            # The row's runs: lists (x - 1, x) of image row y, then of row y - 1, side by side;
            # the row is corner (0, dy) of the second list's samples, (1, dy) of the first's.
            first0, mid0, end0 = _run(ends_ptr, row, x, in_level)
            first1, mid1, end1 = _run(ends_ptr, row - w, x, in_level & (y > 0))
            if JOINED:
                # One slot a row a step: its first run's entries, then its second's, each loaded a
                # step ahead. A decoder's rows hold none or a few: side by side, the two runs
                # took a step's work for each row and run as long as the longest run, mostly idle
                # (bfloat16 decoder: 105 against 88 us, bench/NOTES.md entry 41).
                length0 = end0 - first0
                length = length0 + end1 - first1
                longest = tl.max(length, axis=0)
                index = _joined_index(longest * 0, first0, first1, length0)
                entry = tl.load(entries_ptr + index, mask=0 < length, other=0)
            else:
                longest = tl.maximum(tl.max(end0 - first0, axis=0), tl.max(end1 - first1, axis=0))
            done = longest * 0
            while done < longest:  # (a bound loaded from memory: a while loop, which the interpreter runs too)
                if JOINED:
                    # The next step's entry now, in flight while this step's weight and
                    # grad_output row load: one memory round trip a step, not two.
                    ahead = _joined_index(done + 1, first0, first1, length0)
                    next_entry = tl.load(entries_ptr + ahead, mask=done + 1 < length, other=0)
                    second = done >= length0
                    total = _add_entry(total, entry, index, tl.where(second, mid1, mid0), tl.where(second, end1, end0),
                                       tl.where(second, 1, 0), level, grad_out_ptr, grad_out_stride_b,
                                       grad_out_stride_q, weights_ptr, head_channel, d_ok, scale, num_queries,
                                       NUM_HEADS, NUM_LEVELS, NUM_POINTS, BATCHES_FOLLOW, ROWS_ALIGNED,
                                       SORTED_SUMS)  # fmt: skip
                    entry = next_entry
                    index = ahead
                    done += 1
                else:  # ENTRIES of each run a step, side by side
                    for e in tl.static_range(ENTRIES):
                        index0 = first0 + done + e
                        index1 = first1 + done + e
                        total = _add_entry(total, tl.load(entries_ptr + index0, mask=index0 < end0, other=0), index0,
                                           mid0, end0, 0, level, grad_out_ptr, grad_out_stride_b, grad_out_stride_q,
                                           weights_ptr, head_channel, d_ok, scale, num_queries,
                                           NUM_HEADS, NUM_LEVELS, NUM_POINTS, BATCHES_FOLLOW, ROWS_ALIGNED,
                                           SORTED_SUMS)  # fmt: skip
                        total = _add_entry(total, tl.load(entries_ptr + index1, mask=index1 < end1, other=0), index1,
                                           mid1, end1, 1, level, grad_out_ptr, grad_out_stride_b, grad_out_stride_q,
                                           weights_ptr, head_channel, d_ok, scale, num_queries,
                                           NUM_HEADS, NUM_LEVELS, NUM_POINTS, BATCHES_FOLLOW, ROWS_ALIGNED,
                                           SORTED_SUMS)  # fmt: skip
                    done += ENTRIES
    if SORTED_SUMS:
        grad = total
    else:  # backward.from_fixed_point's conversion: the integer rounded once to float32, times 2**-e.
        grad = total.to(tl.float32) * tl.load(scales_ptr + 1)
    value_row = ((bm // NUM_HEADS) * num_values + pixel) * NUM_HEADS + bm % NUM_HEADS  # (b, pixel, m)
    tl.store(
        grad_value_ptr + value_row[:, None] * HEAD_DIM + channel,
        grad.to(grad_value_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )


@triton.jit
def _run(ends_ptr, top_left, x, ok):
    """(first, mid, end) of the entries of lists top_left - 1 (where x > 0) and top_left, which
    sit side by side; empty where not ok."""
    mid = tl.load(ends_ptr + top_left - 1, mask=ok & (top_left > 0), other=0)
    first = tl.load(ends_ptr + top_left - 2, mask=ok & (x > 0) & (top_left > 1), other=0)
    end = tl.load(ends_ptr + top_left, mask=ok, other=0)
    return tl.where(x > 0, first, mid), mid, end


@triton.jit
def _joined_index(step, first0, first1, length0):
    """Where a row's entry `step` of its two runs one after the other sits."""
    return tl.where(step < length0, first0 + step, first1 + step - length0)


@triton.jit
def _add_entry(
    total, entry, index, mid, end, dy_listed, level, grad_out_ptr, grad_out_stride_b, grad_out_stride_q,
    weights_ptr, head_channel, d_ok, scale, num_queries, NUM_HEADS: tl.constexpr, NUM_LEVELS: tl.constexpr,
    NUM_POINTS: tl.constexpr, BATCHES_FOLLOW: tl.constexpr, ROWS_ALIGNED: tl.constexpr, SORTED_SUMS: tl.constexpr,
):  # fmt: skip
    """total plus, for each row, the contribution of `entry` (in float32 with SORTED_SUMS, else in
    fixed point), loaded from `index` of its run (none past `end`), a sample of `level` listed
    dy_listed image rows above the row's."""
    ok = index < end
    # The row is corner (dx, dy) = (index < mid, dy_listed) of the listed pixel, which is the
    # sample's corner (flags): the sample's corner 2 * dy + dx + flags, at the weight entry +
    # role, where no flag meets the role's bit (else the row is past the sample's corners).
    role = tl.where(index < mid, 1, 0) + 2 * dy_listed
    LK: tl.constexpr = NUM_LEVELS * NUM_POINTS
    # The entry's fields, unsigned: a signed division or remainder, even by a power of two, costs
    # its sign corrections, and every one of a row's threads computes them.
    if entry.dtype == tl.int64:
        code = entry.to(tl.uint64, bitcast=True)
    else:
        code = entry.to(tl.uint32, bitcast=True)
    use = ok & ((entry & role) == 0) & ((code >> 2) % LK // NUM_POINTS == level)
    weight = tl.load(weights_ptr + entry + role, mask=use, other=0.0)
    query = (code // (4 * NUM_HEADS * LK)).to(entry.dtype)  # batch * num_queries + q
    if BATCHES_FOLLOW:  # grad_out's batch stride is num_queries query strides
        row = query * grad_out_stride_q
    else:
        batch = query // num_queries
        row = batch * grad_out_stride_b + (query - batch * num_queries) * grad_out_stride_q
    if ROWS_ALIGNED:
        # The strides are not specialized (they vary with the image): without this hint every
        # channel is a load of its own (a 2-byte load a bfloat16 channel), not one vector a thread.
        row = tl.multiple_of(row, 16)
    grad_out = tl.load(grad_out_ptr + row[:, None] + head_channel, mask=use[:, None] & d_ok, other=0.0)
    if SORTED_SUMS:
        return total + weight[:, None] * grad_out.to(weight.dtype)
    # The backward kernel's fixed point: round-toward-zero(weight * grad_out * scale).
    return total + (weight[:, None] * grad_out.to(weight.dtype) * scale).to(tl.int64)


@triton.jit(do_not_specialize=["grad_out_stride_b", "grad_out_stride_q", "num_queries", "grad_out_numel",
                               "attn_numel", "samples_per_row"])  # fmt: skip
def msda_fixed_point_scale_kernel(
    grad_out_ptr,  # (B, Q, C), channels contiguous
    grad_out_stride_b,
    grad_out_stride_q,
    num_queries,
    channels,
    grad_out_numel,
    attn_ptr,  # (B * Q * M * L * K,) contiguous
    attn_numel,
    maxima_ptr,  # int32 (3,) zeros: the largest |grad_out| and |attn| as bits, and a ticket
    scales_ptr,  # float32 (2,): written 2**e and 2**-e
    samples_per_row,  # Q * L * K
    FIXED_POINT_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """backward.fixed_point_scale in one launch instead of about twenty small ones (about 30 us
    at the decoder, bench/NOTES.md entry 38), to the bit: each program takes its block's largest
    magnitudes as integers (a float's bits without the sign order as the floats do, and NaN's
    above infinity's), atomic max, order-free; the last program to finish turns them into
    2**e and 2**-e."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    index = pid * BLOCK + tl.arange(0, BLOCK)
    query = index // channels  # batch * num_queries + q
    batch = query // num_queries
    offset = batch * grad_out_stride_b + (query - batch * num_queries) * grad_out_stride_q + index - query * channels
    grad_out = tl.load(grad_out_ptr + offset, mask=index < grad_out_numel, other=0.0).to(tl.float32)
    tl.atomic_max(maxima_ptr, tl.max(tl.abs(grad_out).to(tl.int32, bitcast=True), axis=0), sem="relaxed")
    attn = tl.load(attn_ptr + index, mask=index < attn_numel, other=0.0).to(tl.float32)
    tl.atomic_max(maxima_ptr + 1, tl.max(tl.abs(attn).to(tl.int32, bitcast=True), axis=0), sem="relaxed")
    # Release: this program's maxima before its ticket; the last ticket's acquire sees them all.
    if tl.atomic_add(maxima_ptr + 2, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        largest_grad_out = tl.atomic_max(maxima_ptr, 0, sem="acquire").to(tl.float32, bitcast=True)
        largest_attn = tl.atomic_max(maxima_ptr + 1, 0, sem="acquire").to(tl.float32, bitcast=True)
        # fixed_point_scale's float32 products, in its order.
        bound = largest_grad_out * samples_per_row * largest_attn  # (an int: torch.compile may pass a constant)
        # frexp's exponent e (bound < 2**e): 0 for 0; at most -126 for a subnormal (the clamp
        # below gives 2**127 for any of them).
        biased = (bound.to(tl.int32, bitcast=True) >> 23) & 0xFF
        exponent = tl.where(biased == 0, tl.where(bound == 0.0, 0, -126), biased - 126)
        e = tl.minimum(tl.maximum(FIXED_POINT_BITS - exponent, -126), 127)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        # 2**-e: normal down to 2**-126, 2**-127 subnormal.
        inverse = tl.where(e <= 126, (127 - e) << 23, 1 << 22).to(tl.float32, bitcast=True)
        finite = bound < float("inf")  # False for inf and NaN
        tl.store(scales_ptr, tl.where(finite, scale, float("nan")))
        tl.store(scales_ptr + 1, tl.where(finite, inverse, float("nan")))


# Every kernel of the deterministic mode's grad_value (the eager path's launchers).
KERNELS = (
    msda_fixed_point_scale_kernel,
    msda_sample_lists_kernel,
    msda_sort_lists_kernel,
    msda_gather_grad_value_kernel,
)
