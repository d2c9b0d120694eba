"""How the kernels are called: their grid, arguments and launch settings from the tensors, shared
by the registered operators (which launch through torch's `wrap_triton`, so that torch.compile
and export trace them) and the eager fast path (which launches the compiled kernel directly).

Launch settings are explicit (`TileConfig`), chosen by a fixed rule that reads only L, K, D, the
dtypes and whether every pixel is a query (an encoder): never the image size, so
torch.compile(dynamic=True) keeps one program across image sizes. bench/tune.py passes its own
settings instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ahead
from .backward import (
    FIXED_POINT_BITS,
    folds_in_kernel,
    grad_value_accumulator_dtype,
    msda_backward_kernel,
    msda_fold_replicas_kernel,
    replica_rows,
)
from .deterministic import (
    msda_fixed_point_scale_kernel,
    msda_gather_grad_value_kernel,
    msda_sample_lists_kernel,
    msda_sort_lists_kernel,
)

# The installed triton's release ("3.6"). Two things here lean on what a release does not
# promise, so each is taken only on the releases it was checked on, and other releases run
# slower code that is correct whatever they do (bench/NOTES.md entry 104):
# - Gluon (triton.experimental) changes its API from one release to the next: the shared tile's
#   kernel is taken on the triton it was written and measured on, and other releases go without
#   it (as does a triton without Gluon): a new one must not turn into an error at a backward's launch;
# - the lane placement's speed rests on the layouts Triton picks (`LANE_AXES`), and on 3.6 its
#   shuffles' results too (`SHUFFLE`; entry 105).
TRITON_RELEASE = ".".join(triton.__version__.split(".")[:2])
SHARED_TILE_TRITON = ("3.6",)
msda_shared_tile_kernel = None
if TRITON_RELEASE in SHARED_TILE_TRITON:
    try:
        from .shared_tile import msda_shared_tile_kernel
    except Exception:  # noqa: BLE001
        pass


# Points per group unrolled in one loop step. The presets (K = 4) unroll 2 (forward) and 1
# (backward) either way; more only lengthened compiles: at L x K = 128 the forward and backward
# compiled for sm_90 in 2.1-2.4 s with 4 and 0.8-0.95 s with 2 (bench/NOTES.md entry 23).
MAX_UNROLL = 2
MAX_THREADS = 512  # per program: wide rows (D = 256 in float64 is 128 loads of 16 bytes) take fewer queries


def _cdiv(a: int, b: int) -> int:  # triton.cdiv is a jit function: microseconds a call from Python
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TileConfig(NamedTuple):
    """One program: `block_q` queries of one (batch, head); the points of each level split among
    `groups` thread groups; `threads_per_row` threads read each gathered value row, 16 bytes each
    per load (0: as many as read the whole row in one load, up to a warp); `num_warps` follows.
    Programs stay within MAX_THREADS threads (fewer queries, then fewer groups, for wide rows)."""

    block_q: int
    groups: int
    threads_per_row: int
    unroll_levels: int = 0  # forward: unroll the level loop when L * K is at most this
    prefetch: bool = False  # load each loop step's parameters one step ahead (the backward: at one point a group)
    bf16_pairs: bool = False  # forward: read a bfloat16 value as int32 pairs (even head_dim)
    lane_placement: bool = False  # one thread of a row places each sample (`lane_placement`)
    lane_unroll: int = 1  # lane placement: the row's turns unrolled this many at a time (the backward: 1 or 2)
    max_registers: int = 0  # ptxas's register target a thread (Triton's maxnreg); 0: ptxas's choice
    params_ahead: bool = False  # forward, lane placement: each round's sample parameters loaded a round ahead

    @functools.lru_cache(maxsize=256)
    def constexprs(self, head_dim: int, element_size: int, num_points: int) -> dict:
        block_d = _next_power_of_2(head_dim)
        vector = max(1, 16 // element_size)  # elements per 16-byte load
        row_threads = max(1, block_d // vector)
        threads_per_row = min(self.threads_per_row or row_threads, row_threads, 32)
        chunk = min(block_d, vector * threads_per_row)
        block_q, groups = self.block_q, min(self.groups, _next_power_of_2(num_points))
        while block_q > 1 and block_q * groups * threads_per_row > MAX_THREADS:
            block_q //= 2
        while groups > 1 and block_q * groups * threads_per_row > MAX_THREADS:
            groups //= 2
        # Up to MAX_UNROLL points per group unrolled, a loop over the rest: compile time stays
        # bounded in K (and L: levels are a loop too).
        return dict(
            BLOCK_Q=block_q,
            GROUPS=groups,
            UNROLL=min(_cdiv(num_points, groups), MAX_UNROLL),
            CHUNK=chunk,
            BLOCK_D=block_d,
            num_warps=max(1, block_q * groups * threads_per_row // 32),
            **({"maxnreg": self.max_registers} if self.max_registers else {}),
        )


def forward_config(
    num_levels: int, num_points: int, head_dim: int, value_dtype: torch.dtype, encoder: bool = False
) -> TileConfig:
    """The forward's launch rule (bench/NOTES.md, entries 13, 25, 26, 27 and 28, have the sweeps
    behind it): a whole value row per load instruction (fewer threads per row issue fewer
    instructions but cost the L1 more wavefronts per byte), 16 queries, each level's points split
    in two groups, and each sample placed once, by one thread of its row, the row's threads taking
    the samples in turns (`lane_placement`). A register target lets ptxas keep more of the turns'
    gathers in flight (it keeps two at its own choice of 32 registers a thread): float32 at 40
    registers, two turns a step; half precision at 64, four turns a step (on the H200: decoder -6
    to -23%, encoder -1 to -5%; `register_target` says where it applies). Its first forward and
    backward at L * K = 128 took 2.9-4.7 s on an H200 host, mostly Triton's per-process work
    (entries 29-30). bfloat16 reads the value as int32 pairs in either loop (one integer op an
    element to float32 instead of about two: its encoder -4 to -6%, entry 31).

    Where the lane placement does not apply (float64, 64-bit indices, narrow tiles), the loop of
    entry 25: float32 and bfloat16 load each step's parameters a step ahead, float16 keeps the
    plain loop (the prefetch lost it 3-4% at the encoder).
    Unrolling the level loop as well compiled in 1.7 to 6.5 s instead of 0.2 to 0.6 s: not taken.

    encoder (`every_pixel_a_query`, and the register target applies): programs of one warp (2
    queries at head_dim 32 in float32, 4 in half precision), float32 at 56 registers. On the H200
    the float32 encoder preset ran 197 us against 209 (uniform) and 171 against 185 (`local`) at
    64 registers, and 56 took another 1.7% off uniform for 0.5% on `local` (entry 36); the half
    encoders at one warp, against 16 queries (entry 38, uniform / `local`): float16 131.5 / 124.5
    us against 132.2 / 126.0, bfloat16 129.4 / 127.8 against 135.5 / 128.8; the decoder's few
    queries lose with one warp (11.8 against 9.2 us: its programs no longer fit in one wave), hence the
    two rules. Measured at head_dim 32 (entry 34); other widths keep one warp a program.
    With fewer samples a query than the presets' L * K = 16, a program takes proportionally more
    queries (`_queries_scale`), or the block scheduler's rate bounds the kernel: at BEVFormer's
    temporal self-attention (one 200 x 200 level, K = 4, Q = S = 40,000, B = 2; 320,000 one-warp
    programs) the float32 forward took 194.8 us at 2 queries against 131.1 at 8, float16 98.9
    at 4 against 85.4 at 16 (H100, entry 91); at L * K = 8, 64.9 against 60.8 (float32).

    Half-precision decoders load each round's sample parameters during the round before
    (`params_ahead`; at the presets a program has two rounds): in an A/B on the H200 float16
    6.23 -> 5.95 us, `local` 5.82 -> 5.64, bfloat16 6.15 -> 5.93 and 5.73 -> 5.69; their one-warp
    encoders lost 2-3% with it under `local` (entry 69). Float32 has one round at the presets:
    unmeasured."""
    half = value_dtype in (torch.float16, torch.bfloat16)
    if encoder and (half or value_dtype == torch.float32):
        # 16-byte loads of a row: its threads.
        row_threads = max(1, min(32, _next_power_of_2(head_dim) * value_dtype.itemsize // 16))
        return TileConfig(
            block_q=max(2, 32 // (2 * row_threads)) * _queries_scale(num_levels * num_points),
            groups=2,
            threads_per_row=0,
            prefetch=value_dtype != torch.float16,
            bf16_pairs=value_dtype == torch.bfloat16,
            lane_placement=True,
            lane_unroll=4 if half else 2,
            max_registers=64 if half else 56,
        )
    return TileConfig(
        block_q=16,
        groups=2,
        threads_per_row=0,
        prefetch=value_dtype != torch.float16,
        bf16_pairs=value_dtype == torch.bfloat16,
        lane_placement=True,
        lane_unroll=4 if half else 2,
        max_registers=64 if half else 40,
        params_ahead=half,
    )


def _queries_scale(samples: int) -> int:
    """How many times the encoder forward's queries a program at `samples` (L * K) samples a
    query: the largest power of two at most 16 / samples (1 from 9 samples up), so that a program
    does about the presets' work."""
    return 1 << (max(1, 16 // max(1, samples)).bit_length() - 1)


def every_pixel_a_query(num_queries, num_values) -> bool:
    """Whether a call is an encoder's self-attention, each pixel of the pyramid a query (Q == S):
    many queries a (batch, head), whatever the image size. It picks tiles and passes, never
    results: every rule is exact at any shape.

    Under torch.compile and export the sizes may be symbols: one symbol where dynamic shapes
    made them one (`dynamic=True` gives two sizes equal when first traced one symbol); two where
    an export gave them separate dims, or a compile followed a call with Q != S (dynamo's
    automatic dynamic shapes then give each its own: bench/NOTES.md entries 51 and 53).
    Then the sizes the graph was traced at answer, with no guard: no recompile, no constraint
    on an export's dims. A graph traced at an encoder's sizes keeps the encoder's rules at any
    later size (and stays exact if ever called with Q != S)."""
    if statically_known_true(num_queries == num_values):
        return True
    queries, values = _traced_size(num_queries), _traced_size(num_values)
    return queries is not None and queries == values


def _traced_size(size) -> int | None:
    """An int, or a symbolic size's value at tracing (its hint; None for a data-dependent one)."""
    return size if isinstance(size, int) else size.node.hint


def backward_config(
    num_levels: int, num_points: int, head_dim: int, value_dtype: torch.dtype, encoder: bool = False,
    lists: bool = False,
) -> TileConfig:
    """The backward's launch rule (bench/NOTES.md, entry 13): a whole row per load and per atomic
    (the L2 handles fewer, larger reductions better), 4 queries, points in four groups, each
    step's parameters loaded a step ahead where a step holds one point a group (K <= 4: 0.1-1.8
    us off the decoders, entry 31). Encoders (`every_pixel_a_query`) take smaller programs:
    half precision 2 queries (569 us against 584 at the preset, 540 against 554 under `local`,
    entry 38), float32 1 query, one warp at head_dim 32 (869-884 us against 885-891, 828-849
    against 839-859 under `local`, entry 48; 1 query costs the half encoders 30%). Both lose at
    the decoder (4 us at 2 queries in entry 33's tiles), hence the encoder alone.

    Each sample placed once, by one thread of its row (`lane_placement`), where the adds go
    straight to grad_value (not the replicas of the half-precision encoders, nor the float32
    encoder's level left to the shared tile): on the H200 (entry 57, fresh grad_value a call) the
    float32 decoder 62.2 us against 65.6 (59.3 against 62.4 under `local`), the float32 encoder
    without the shared tile 854 against 870 (805 against 824), and the half-precision decoders at 2
    queries, the rows of two turns loaded before their adds (`lane_unroll` 2), 36.2-36.6 against
    37.6-37.7 (33.4-33.9 against 35.2-35.4). Float32 gained nothing from the two turns (entry 57).

    lists: the deterministic mode's kernel, which leaves grad_value to its lists (no atomics), 2
    queries everywhere: the whole deterministic backward of the decoders 81.1 us against 88.6
    (bfloat16), 82.1 against 88.8 (float16), 103.4 against 106.1 (float32), of the float32
    encoder 1414 against 1419 (graph replay, entry 41)."""
    half = value_dtype in (torch.float16, torch.bfloat16)
    if lists or (encoder and half):
        return TileConfig(block_q=2, groups=4, threads_per_row=0, prefetch=True)
    if encoder and value_dtype == torch.float32:
        return TileConfig(block_q=1, groups=4, threads_per_row=0, prefetch=True, lane_placement=True)
    if half and head_dim % 8 == 0:  # where the lane placement applies: 2 queries, two turns a step
        return TileConfig(block_q=2, groups=4, threads_per_row=0, prefetch=True, lane_placement=True, lane_unroll=2)
    return TileConfig(block_q=4, groups=4, threads_per_row=0, prefetch=True, lane_placement=True)


def compute_dtype(*tensors: Tensor):
    """float64 arithmetic for float64 inputs (gradcheck), float32 for everything else."""
    for t in tensors:  # (a loop, not any(): this runs on every eager call)
        if t.dtype == torch.float64:
            return tl.float64
    return tl.float32


# The softmax operators on CUDA: True has the kernels normalize the logits themselves
# (SOFTMAX=True); False (the default) runs torch.softmax, then the plain kernels. The fused
# kernels are right (the GPU tier tests both forms) but slower at the encoder: on the H200 the
# layer's forward took 935 us fused against 868 us unfused in float32 and 380 against 352 us in
# bfloat16, and tied at the decoder (bench/NOTES.md entries 18 and 20). Off until they win.
FUSED_SOFTMAX = False


def softmax_scratch_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype of the backward's softmax scratch: the compute dtype of a call on `tensors`."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _pairs_readable(value: Tensor) -> bool:
    """Whether a value's bfloat16 rows can be read as int32 pairs: an even head_dim, and data that
    starts 4-byte aligned. PyTorch's allocators align every storage (the CUDA one to 512 bytes),
    so the storage offset decides; data_ptr() is not asked, as under torch.compile the tensor is
    a fake one whose data_ptr() means nothing."""
    return value.dtype == torch.bfloat16 and value.shape[-1] % 2 == 0 and value.storage_offset() % 2 == 0


def lane_placement(config: TileConfig, constexprs: dict, element_size: int) -> bool:
    """Whether the forward takes `forward._lane_placed_samples` (and the backward its lane
    placement, where its adds are plain ones: `_backward_constexprs`): asked for, a row read with one
    load a thread, float32 arithmetic (its shuffles pass 32-bit values), 32-bit indices, no
    softmax, the points of each level in two or more groups (so that each thread's parameters
    are not a vector of its neighbours', which Triton would load in another layout), and a tile
    of at least a warp's threads: with fewer, Triton spreads a row's vector over more threads
    and the shuffles' lanes are no longer the row's (scripts/compile_check.py checks the
    layouts). Where it applies it takes precedence over a config's prefetch; int32 pairs apply to
    either loop. It is taken on NVIDIA GPUs with a triton release in `LANE_AXES` and in the
    interpreter; elsewhere (another release, ROCm) the config's loop runs."""
    lanes = constexprs["CHUNK"] // max(1, 16 // element_size)
    return (
        config.lane_placement
        and LANE_AXIS is not None
        and constexprs["CHUNK"] == constexprs["BLOCK_D"]
        and constexprs["GROUPS"] >= 2
        and constexprs["BLOCK_Q"] * constexprs["GROUPS"] * lanes >= 32
        and constexprs["COMPUTE"] == tl.float32
        and not (constexprs["INDEX_64"] or constexprs["SOFTMAX"])
    )


# The lane placement passes each sample's placement round its row with a gather along the tile's
# lane axis (`sampling.from_lane`): right in any layout, one warp shuffle where that axis lies
# over consecutive lanes of a warp. Which tile order gets that layout hangs on how a release
# breaks ties between equally contiguous axes: 3.6 puts the first axis next to the contiguous
# one, 3.7 and 3.8 the one before it, so the lanes go first on 3.6 and third on 3.7 and 3.8
# (`sampling.lane_tile`; scripts/compile_check.py reads the layouts, bench/NOTES.md entry 105).
# On 3.6 the placements go by PTX shuffles (`SHUFFLE`), as before entry 105: it lowers a gather
# across all 32 lanes (rows of 128 float32) through shared memory, and compile_check checks the
# shuffles' layout there. A release not listed runs each config's own loop, whose speed does not
# hang on its layouts; so does ROCm, where the lane placement was never measured. The
# interpreter (CPU) takes it, with gathers. Read once, as Triton itself decides at import
# whether its kernels are interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LANE_AXES = {"3.6": 0, "3.7": 2, "3.8": 2}
SHUFFLE_TRITON = ("3.6",)
if INTERPRETED:  # either order is right there: the installed release's, else the newest
    LANE_AXIS = LANE_AXES.get(TRITON_RELEASE, 2)
else:
    LANE_AXIS = None if torch.version.hip is not None else LANE_AXES.get(TRITON_RELEASE)
SHUFFLE = LANE_AXIS == 0 and not INTERPRETED and TRITON_RELEASE in SHUFFLE_TRITON


def _lane_order() -> dict:
    """The kernels' LANE_AXIS and SHUFFLE (read at each call: tests set the module's flags). The
    shuffles' segments are the lowest lane bits, so they go with the lanes first alone."""
    return dict(LANE_AXIS=LANE_AXIS or 0, SHUFFLE=SHUFFLE and LANE_AXIS == 0)


@functools.lru_cache(maxsize=None)
def register_target(device: torch.device) -> bool:
    """Whether launches on `device` take a config's `max_registers` (Triton's maxnreg): NVIDIA
    GPUs of compute capability 9 (Hopper), where the targets were measured. On other GPUs the
    trade (more loads in flight a warp, fewer warps an SM) is unmeasured, so ptxas chooses."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def _with_launch_options(kernel, num_warps: int, maxnreg: int):
    return triton.autotune(configs=[triton.Config({}, num_warps=num_warps, maxnreg=maxnreg)], key=[])(kernel)


def traceable(kernel, constexprs: dict) -> tuple:
    """(kernel, keyword arguments) for `wrap_triton(kernel)[grid](*args, **kwargs)`: torch.compile
    and export take a launch's num_warps from its keyword arguments but not maxnreg, which they
    read from the configs of a `triton.autotune` kernel. So a launch with a register target runs
    a one-config autotuner (no benchmarking: there is one config) holding both."""
    if "maxnreg" not in constexprs:
        return kernel, constexprs
    kwargs = dict(constexprs)
    return _with_launch_options(kernel, kwargs.pop("num_warps"), kwargs.pop("maxnreg")), kwargs


def needs_int64(*tensors: Tensor) -> bool:
    """Whether an element offset into any of `tensors` can reach 2**31 (then kernels index in
    int64; int32 otherwise, which saves registers on every gathered address)."""
    for t in tensors:  # (a loop, not any(): this runs on every eager call)
        if _span(t) >= 2**31:
            return True
    return False


def _span(t: Tensor) -> int:
    """1 + the largest element offset into `t`."""
    if t.is_contiguous():
        return t.numel()
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def forward_call(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    out: Tensor,
    config: TileConfig | None = None,
    *,
    softmax: bool = False,
) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional arguments, constexpr arguments) of msda_forward_kernel. The tensors must
    be contiguous; level_start_index None has the kernel sum the level sizes; softmax: the last
    tensor holds logits, normalized in the kernel. int() specializes the per-model constants
    M, L, K, D under dynamic shapes; B, Q and S stay symbolic."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    constexprs = _forward_constexprs(
        int(L), int(K), int(M), int(D), value.dtype, compute_dtype(value, sampling_locations, attention_weights),
        register_target(value.device), every_pixel_a_query(Q, S), needs_int64(value, sampling_locations, out),
        level_start_index is not None, softmax, _pairs_readable(value), config or forward_config,
    )  # fmt: skip
    grid = (_cdiv(Q, constexprs["BLOCK_Q"]) * B * M,)
    tensors = forward_tensors(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out)
    args = (*tensors, Q, S)
    return grid, args, dict(constexprs)


def forward_tensors(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None, sampling_locations: Tensor,
    attention_weights: Tensor, out: Tensor,
) -> tuple:  # fmt: skip
    """msda_forward_kernel's tensor arguments, in order (its integers, Q and S, follow them)."""
    starts = spatial_shapes if level_start_index is None else level_start_index  # unread if None
    return value, spatial_shapes, starts, sampling_locations, attention_weights, out


def forward_signature(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None, sampling_locations: Tensor,
    attention_weights: Tensor, softmax: bool,
) -> tuple:  # fmt: skip
    """What `forward_call` reads of a call on contiguous tensors (the output is value's dtype and
    the shape the sizes give), as a key: two calls with equal keys get the same grid, integers,
    tensor dtypes and constexprs, so an eager launch prepared for one serves the other
    (msda/eager.py). Keep it in step with forward_call; tests/test_direct_launch.py checks it."""
    return (
        value.shape, value.dtype, value.device, value.storage_offset() & 1, spatial_shapes.dtype,
        None if level_start_index is None else level_start_index.dtype, sampling_locations.shape,
        sampling_locations.dtype, attention_weights.dtype, softmax, forward_config,
    )  # fmt: skip


# The settings of a launch are a function of these few facts of a call, so they are computed once
# for each: building them took about half of an eager forward call's Python (bench/NOTES.md entry
# 42). `config` is a TileConfig or the launch rule that gives one: a parameter, so that another
# rule (the tests replace it) is a key of its own.
@functools.lru_cache(maxsize=256)
def _forward_constexprs(
    L: int, K: int, M: int, D: int, dtype: torch.dtype, compute, hopper: bool, every_pixel: bool, index_64: bool,
    level_starts: bool, softmax: bool, pairs_readable: bool, config,
) -> dict:  # fmt: skip
    if not isinstance(config, TileConfig):
        config = config(L, K, D, dtype, hopper and every_pixel)
    constexprs = dict(config.constexprs(D, dtype.itemsize, K))
    constexprs.update(
        NUM_HEADS=M,
        HEAD_DIM=D,
        NUM_LEVELS=L,
        NUM_POINTS=K,
        LEVELS_UNROLLED=L * K <= config.unroll_levels,
        COMPUTE=compute,
        INDEX_64=index_64,
        LEVEL_STARTS=level_starts,
        SOFTMAX=softmax,
        PREFETCH=bool(config.prefetch),
    )
    # Where the lane placement does not apply, the config's other settings choose the loop.
    constexprs.update(LANE_PLACEMENT=lane_placement(config, constexprs, dtype.itemsize), **_lane_order())
    constexprs["LANE_UNROLL"] = max(1, int(config.lane_unroll))
    constexprs["PARAMS_AHEAD"] = bool(config.params_ahead) and constexprs["LANE_PLACEMENT"]
    if not (constexprs["LANE_PLACEMENT"] and hopper):  # where the targets were measured
        constexprs.pop("maxnreg", None)
    constexprs["BF16_PAIRS"] = bool(config.bf16_pairs) and pairs_readable
    return constexprs


def backward_call(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    grad_value: Tensor | None,
    grad_loc: Tensor,
    grad_attn: Tensor,
    config: TileConfig | None = None,
    *,
    softmax: bool = False,
    scratch: Tensor | None = None,
    fixed_point_scale: Tensor | None = None,
    replicas: Tensor | None = None,
    fold_counts: Tensor | None = None,
    lists: ListBuffers | None = None,
    shared_tile: bool = False,
) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional arguments, constexpr arguments) of msda_backward_kernel; grad_output's
    channels must be contiguous (its other strides may be anything, 0 included), the other
    tensors contiguous, grad_value zeroed.

    softmax: attention_weights holds logits and grad_attn gets their gradient; the kernel then
    needs `scratch`, contiguous like them in the compute dtype (`softmax_scratch_dtype`), which
    may be grad_attn itself when that has the compute dtype.

    fixed_point_scale (the deterministic mode, `backward.fixed_point_scale`): grad_value is int64
    zeros, summed in fixed point; `backward.from_fixed_point` converts it.

    replicas (`backward.grad_value_buffer`): zeros like grad_value, (B, rows, M, D), that dense
    levels are summed into besides grad_value; `fold_call`'s kernel then adds them to grad_value,
    or, given fold_counts (int32 zeros, (B, M): `backward.folds_in_kernel`), this kernel does.

    grad_value None: the kernel computes the other two gradients alone (the deterministic mode's
    `deterministic_grad_value` sums grad_value); with `lists` (`list_buffers`) it also counts the
    samples of that mode's lists and leaves each one's rank in its list.

    shared_tile (`shared_tile_applies`): the last level's adds are left to `shared_tile_call`'s
    kernel where that level fits its tile."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    summed_by_lists = grad_value is None  # the deterministic mode's lists sum grad_value
    constexprs = _backward_constexprs(
        int(L), int(K), int(M), int(D), value.dtype, compute_dtype(value, sampling_locations, attention_weights),
        every_pixel_a_query(Q, S),
        needs_int64(value, sampling_locations, grad_output, *([] if lists is None else lists)),
        level_start_index is not None, softmax, fixed_point_scale is not None and not summed_by_lists,
        replicas is not None, 0 if summed_by_lists else grad_value.element_size(),
        not summed_by_lists and value_rows_evicted_first(grad_value, value.device, Q, S),
        0 if lists is None else list_rule(Q, S, value).count_stride,
        SHARED_TILE_PIXELS if shared_tile else 0,
        (FOLD_STEP_ELEMENTS, FOLD_UNROLL) if fold_counts is not None else None,
        config or (LIST_BACKWARD if summed_by_lists else None) or backward_config,
    )  # fmt: skip
    if softmax and scratch is None:
        raise ValueError("backward_call: softmax=True needs a scratch tensor")
    grid = (_cdiv(Q, constexprs["BLOCK_Q"]) * B * M,)
    grad_output, *tensors = backward_tensors(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_value,
        grad_loc, grad_attn, scratch=scratch if softmax else None, fixed_point_scale=fixed_point_scale,
        replicas=replicas, fold_counts=fold_counts, lists=lists,
    )  # fmt: skip
    args = (
        grad_output, grad_output.stride(0), grad_output.stride(1), *tensors, Q, S,
        0 if replicas is None else replicas.shape[1],
    )  # fmt: skip
    return grid, args, dict(constexprs)


def backward_tensors(
    grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None,
    sampling_locations: Tensor, attention_weights: Tensor, grad_value: Tensor | None, grad_loc: Tensor,
    grad_attn: Tensor, *, scratch: Tensor | None = None, fixed_point_scale: Tensor | None = None,
    replicas: Tensor | None = None, fold_counts: Tensor | None = None, lists: ListBuffers | None = None,
) -> tuple:  # fmt: skip
    """msda_backward_kernel's tensor arguments, in order (grad_output's two strides follow the
    first; Q, S and the replicas' rows the last). An absent one's place takes a tensor the kernel
    leaves alone: spatial_shapes, or the weights for `scratch` (an input, never an output: two
    outputs that alias would trouble torch.compile's reinplacing of the kernel's writes)."""
    if lists is not None:
        counts = lists.counters
    else:  # unwritten if None
        counts = spatial_shapes if fold_counts is None else fold_counts
    return (
        grad_output,
        value,
        spatial_shapes,
        spatial_shapes if level_start_index is None else level_start_index,  # unread if None
        sampling_locations,
        attention_weights,
        spatial_shapes if grad_value is None else grad_value,  # unwritten if None
        spatial_shapes if replicas is None else replicas,  # unread if None
        spatial_shapes if fixed_point_scale is None or grad_value is None else fixed_point_scale,  # unread if None
        grad_loc,
        grad_attn,
        attention_weights if scratch is None else scratch,  # unused without softmax
        counts,
        spatial_shapes if lists is None else lists.weights,  # unwritten if None
    )


def backward_signature(
    grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None,
    sampling_locations: Tensor, attention_weights: Tensor, grad_value: Tensor, replicas: Tensor | None = None,
    fold_counts: Tensor | None = None,
) -> tuple:  # fmt: skip
    """What `backward_call` reads of a plain call (grad_value the zeros it adds into, with or
    without replicas: no softmax, fixed point, lists or shared tile) on contiguous tensors and a
    grad_output with contiguous channels, as a key: two such calls with equal keys get the same
    grid, integers, tensor dtypes and constexprs, as `forward_signature` for the forward. Keep it
    in step with backward_call; tests/test_direct_launch.py checks it."""
    return (
        grad_output.stride(), grad_output.dtype, value.shape, value.dtype, value.device,
        spatial_shapes.dtype, None if level_start_index is None else level_start_index.dtype,
        sampling_locations.shape, sampling_locations.dtype, attention_weights.dtype, grad_value.dtype,
        None if replicas is None else (replicas.shape, replicas.dtype), fold_counts is None, backward_config,
        FOLD_STEP_ELEMENTS, FOLD_UNROLL,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _backward_constexprs(
    L: int, K: int, M: int, D: int, dtype: torch.dtype, compute, every_pixel: bool, index_64: bool,
    level_starts: bool, softmax: bool, fixed_point: bool, replicas: bool, accumulator_size: int,
    value_evicted_first: bool, count_stride: int, tile_pixels: int, fold: tuple[int, int] | None, config,
) -> dict:  # fmt: skip
    """backward_call's settings (accumulator_size: grad_value's element size, 0 for the lists;
    fold: the replicas folded in the kernel, (FOLD_STEP_ELEMENTS, FOLD_UNROLL); config: a
    TileConfig or the launch rule, as for `_forward_constexprs`)."""
    if not isinstance(config, TileConfig):
        config = config(L, K, D, dtype, every_pixel, **({"lists": True} if accumulator_size == 0 else {}))
    constexprs = dict(config.constexprs(D, dtype.itemsize, K))
    constexprs.update(
        NUM_HEADS=M,
        HEAD_DIM=D,
        NUM_LEVELS=L,
        NUM_POINTS=K,
        COMPUTE=compute,
        INDEX_64=index_64,
        LEVEL_STARTS=level_starts,
        SOFTMAX=softmax,
        FIXED_POINT=fixed_point,
        REPLICAS=replicas,
        # 4- and 8-byte accumulators: the last batch first (the kernel says why). Measured on the
        # H200: the float32 decoder 70.7 -> 65.4 us; the float16 one, whose 45 MB grad_value stays
        # in the L2 anyway, lost 3 us with it (bench/NOTES.md entry 34).
        LAST_BATCH_FIRST=accumulator_size >= 4,
        GRAD_VALUE=accumulator_size > 0,
        VALUE_EVICTION="evict_first" if value_evicted_first else "",
        COUNT_STRIDE=count_stride,
        TILE_PIXELS=tile_pixels,
        # A fold step: pixels of one head's channels, FOLD_STEP_ELEMENTS a thread (the decoders
        # run 1-warp programs, whose registers a fold kernel's tile would double).
        FOLD_PIXELS=0 if fold is None else max(1, fold[0] * 32 * constexprs["num_warps"] // constexprs["BLOCK_D"]),
        FOLD_UNROLL=1 if fold is None else fold[1],
    )
    constexprs["PREFETCH"] = bool(config.prefetch) and constexprs["UNROLL"] == 1
    # The lane placement adds into grad_value or its replicas, not in fixed point, or beside the
    # lists or the shared tile; and its rows must start on whole 16-byte vectors: where they
    # may not (D = 6 in float32), Triton lays the adds' vectors over two threads, and the
    # placements' shuffles with them (scripts/compile_check.py caught it).
    plain_adds = accumulator_size in (2, 4) and not (fixed_point or count_stride or tile_pixels)
    whole_vectors = D % (16 // dtype.itemsize) == 0
    constexprs.update(
        LANE_PLACEMENT=plain_adds and whole_vectors and lane_placement(config, constexprs, dtype.itemsize),
        **_lane_order(),
        LANE_UNROLL=min(2, max(1, int(config.lane_unroll))),
    )
    return constexprs


def value_rows_evicted_first(grad_value: Tensor, device: torch.device, num_queries, num_values) -> bool:
    """Whether the backward's value gathers carry an evict-first hint, so that the L2 keeps the
    grad_value rows they add into: at a decoder, whose value rows are each gathered about once
    (Q * L * K * 4 / S = 0.9 corners a row at the preset; an encoder's 64 reuse theirs from the
    L2), with a half-precision or float32 grad_value. On the H200 the half decoders ran
    38.4-39.1 us against 40.1-40.3 (bench/NOTES.md entry 36), the float32 one, since the lane
    placement, 59.6-59.7 against 60.4-61.7 (56.5-56.7 against 57.5-58.5 `local`, entry 59; even
    with entry 36's kernel); the encoders 1.5-5% slower. Measured on Hopper only
    (`register_target` of the inputs' device: grad_value may be a meta tensor, as
    `backward_launches` makes it)."""
    return (
        grad_value.element_size() in (2, 4)
        and register_target(device)
        and not every_pixel_a_query(num_queries, num_values)
    )


# The last level's grad_value summed in shared memory by kernels/shared_tile.py (a Gluon kernel;
# bench/NOTES.md entry 49): on the H200 the float32 encoder preset's backward 822-831 us against
# 868-872, 791-800 against 826-840 under `local`. On unless MSDA_SHARED_TILE=0; a traced backward
# launches it through msda::add_shared_tile_ (ops.py), which Inductor keeps an opaque call.
SHARED_TILE = os.environ.get("MSDA_SHARED_TILE", "1") != "0"
SHARED_TILE_PIXELS = 284  # a level of at most this many pixels fits the tile (its rows, four for outside, 32 to stage)
SHARED_TILE_QUERIES = 256  # queries a program (entry 49: 64 / 128 / 256 took 167 / 147 / 142 us)


def shared_tile_applies(
    value: Tensor, sampling_locations: Tensor, grad_output: Tensor, grad_value: Tensor | None, *, softmax: bool,
    fixed_point: bool, replicas: bool,
) -> bool:  # fmt: skip
    """Whether a backward call's last level goes to the shared-memory tile: where it is on and
    measured (float32 and its accumulator, head_dim 32, 4 points, every pixel a query, Hopper,
    32-bit indices; not the deterministic mode, the fused softmax or replicas), on CUDA tensors
    (traced ones too: the operator's traced body calls the kernel through msda::add_shared_tile_,
    which Inductor keeps opaque; not in the interpreter, which cannot run Gluon). Whether the
    level fits the tile is the kernels' to say, on the device."""
    if grad_value is None or softmax or fixed_point or replicas or grad_value.dtype != torch.float32:
        return False
    return _shared_tile_shape(value, sampling_locations) and not needs_int64(value, sampling_locations, grad_output)


def _shared_tile_shape(value: Tensor, sampling_locations: Tensor) -> bool:
    """`shared_tile_applies`' conditions on the inputs alone."""
    if not SHARED_TILE or msda_shared_tile_kernel is None:
        return False
    _, Q, _, _, K, _ = sampling_locations.shape
    return (
        value.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and value.dtype == torch.float32
        and value.shape[3] == 32
        and K == 4
        and every_pixel_a_query(Q, value.shape[1])
        and register_target(value.device)
    )


# Whether a forward whose backward will run compiles that backward's kernels in a thread
# (`compile_backward_ahead`); scripts/first_call.py turns it off to measure what it saves.
COMPILE_AHEAD = True
_AHEAD_CALLS: set[tuple] = set()  # the calls (shapes, dtypes) whose backward `compile_backward_ahead` began


def compile_backward_ahead(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None, sampling_locations: Tensor,
    attention_weights: Tensor,
) -> None:  # fmt: skip
    """From a forward whose backward will run: start compiling the kernels that backward will
    launch (kernels/ahead.py), so that their compiles overlap the forward's own and whatever runs
    before the backward: the backward kernel (a second or two of a first forward + backward on
    an H200 host, bench/NOTES.md entries 27 and 63), the replicas' fold where it takes replicas,
    and the shared tile's kernel where it takes the tile (over a second, entry 51). Each under
    the key its launch will compute, for a contiguous grad_output (autograd's, unless a sum's
    expanded one: that launch compiles again). Not while tracing (a thread is for a call that
    runs now) or capturing a graph, and not in the deterministic mode (its lists' kernels)."""
    if not (COMPILE_AHEAD and type(value) is torch.Tensor and value.is_cuda):
        return
    # Once a process for each call's shapes and dtypes, looked up first: every later call with
    # grad of those shapes ends here (ahead.start keeps one compile a key as well).
    call = (
        value.device.index, value.dtype, value.shape, sampling_locations.dtype, sampling_locations.shape,
        attention_weights.dtype, level_start_index is None,
    )  # fmt: skip
    if call in _AHEAD_CALLS or not (
        attention_weights.numel() > 0
        and not torch.are_deterministic_algorithms_enabled()
        and os.environ.get("TRITON_INTERPRET") != "1"
        and not torch.cuda.is_current_stream_capturing()
    ):
        return
    _AHEAD_CALLS.add(call)
    for kernel, args, constexprs in backward_launches(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    ):
        ahead.start(kernel, args, constexprs, value.device)


def backward_launches(
    value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None, sampling_locations: Tensor,
    attention_weights: Tensor,
) -> list[tuple]:  # fmt: skip
    """(kernel, positional arguments, constexpr arguments) of each launch of the default (atomic)
    backward of a call on these tensors, with a contiguous grad_output: as the backward computes
    them (eager.launch_backward, ops._launch_backward), its buffers as meta tensors."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    grad_output = torch.empty_strided((B, Q, M * D), (Q * M * D, M * D, 1), dtype=value.dtype, device="meta")
    dtype = grad_value_accumulator_dtype(value, Q, L, K)
    grad_value = torch.empty(value.shape, dtype=dtype, device="meta")
    rows = replica_rows(dtype, Q, S, L, K)
    replicas = None if rows is None else torch.empty((B, rows, M, D), dtype=dtype, device="meta")
    in_kernel = rows is not None and folds_in_kernel(rows, D)
    fold_counts = torch.empty((B, M), dtype=torch.int32, device="meta") if in_kernel else None
    grad_loc = torch.empty(sampling_locations.shape, dtype=sampling_locations.dtype, device="meta")
    grad_attn = torch.empty(attention_weights.shape, dtype=attention_weights.dtype, device="meta")
    shared_tile = shared_tile_applies(
        value, sampling_locations, grad_output, grad_value, softmax=False, fixed_point=False,
        replicas=replicas is not None,
    )  # fmt: skip
    inputs = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    _, args, constexprs = backward_call(
        grad_output, *inputs, grad_value, grad_loc, grad_attn, replicas=replicas, fold_counts=fold_counts,
        shared_tile=shared_tile,
    )  # fmt: skip
    launches = [(msda_backward_kernel, args, constexprs)]
    if replicas is not None and fold_counts is None:
        _, args, constexprs = fold_call(grad_value, replicas, spatial_shapes, level_start_index, Q, K)
        launches.append((msda_fold_replicas_kernel, args, constexprs))
    if shared_tile:
        _, args, constexprs = shared_tile_call(grad_output, *inputs, grad_value)
        launches.append((msda_shared_tile_kernel, args, constexprs))
    return launches


def shared_tile_call(
    grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None,
    sampling_locations: Tensor, attention_weights: Tensor, grad_value: Tensor,
) -> tuple[tuple[int], tuple, dict]:  # fmt: skip
    """(grid, positional arguments, constexpr arguments) of msda_shared_tile_kernel for a call
    `shared_tile_applies` took, after the backward kernel's launch with shared_tile=True."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    grid = (B * M * _cdiv(Q, SHARED_TILE_QUERIES),)
    args = (
        grad_output, grad_output.stride(0), grad_output.stride(1), spatial_shapes,
        spatial_shapes if level_start_index is None else level_start_index,  # unread if None
        sampling_locations, attention_weights, grad_value, Q, S,
    )  # fmt: skip
    constexprs = dict(
        LVL=int(L) - 1, NUM_HEADS=int(M), HEAD_DIM=int(D), NUM_LEVELS=int(L), NUM_POINTS=int(K),
        QB=SHARED_TILE_QUERIES, DUMMY=SHARED_TILE_PIXELS, STAGE=SHARED_TILE_PIXELS + 4, ROWS=SHARED_TILE_PIXELS + 36,
        LEVEL_STARTS=level_start_index is not None, num_warps=4,
    )  # fmt: skip
    return grid, args, constexprs


FOLD_TILE_ELEMENTS = 2048  # a fold program's pixels times their M * D elements (rounded up to a power of 2)
# A fold program sums at least this many replicas of its pixels (more where the level's programs
# are too few), in float32, before its one add into grad_value: a level of at most this many
# replicas is rounded into grad_value once, as the encoder preset's coarsest (14) is. UNROLL of
# their loads are in flight at once (bench/NOTES.md entry 97).
FOLD_REPLICAS_A_PROGRAM = 16
FOLD_UNROLL = 4
# Where the backward kernel folds (`backward.folds_in_kernel`), its step takes this many
# elements a thread, each of FOLD_UNROLL loads (8: 104 registers in the float16 decoder kernel
# for 98 without the fold, the same 19 programs of a warp an SM; its whole tile, 2,048 elements,
# took 144).
FOLD_STEP_ELEMENTS = 8


def fold_call(
    grad_value: Tensor,
    replicas: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    num_queries: int,
    num_points: int,
) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional arguments, constexpr arguments) of msda_fold_replicas_kernel, after the
    backward kernel summed into grad_value and `replicas` (both contiguous)."""
    B, S, M, D = grad_value.shape
    rows = replicas.shape[1]
    L = int(spatial_shapes.shape[0])
    block_row = _next_power_of_2(int(M) * int(D))
    block_pixels = max(1, FOLD_TILE_ELEMENTS // block_row)
    constexprs = dict(
        NUM_LEVELS=L,
        NUM_POINTS=int(num_points),
        ROW=int(M) * int(D),
        BLOCK_ROW=block_row,
        BLOCK_PIXELS=block_pixels,
        REPLICAS_A_PROGRAM=FOLD_REPLICAS_A_PROGRAM,
        UNROLL=FOLD_UNROLL,
        INDEX_64=needs_int64(grad_value, replicas),
        LEVEL_STARTS=level_start_index is not None,
        num_warps=4,
    )
    grid = (B * L * _cdiv(rows, block_pixels),)
    # level_start_index None: spatial_shapes in its place, unread
    args = (*fold_tensors(grad_value, replicas, spatial_shapes, level_start_index), num_queries, S, rows)
    return grid, args, constexprs


def fold_tensors(
    grad_value: Tensor, replicas: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None
) -> tuple:
    """msda_fold_replicas_kernel's tensor arguments, in order (the integers follow)."""
    return grad_value, replicas, spatial_shapes, spatial_shapes if level_start_index is None else level_start_index


def fold_signature(
    grad_value: Tensor, replicas: Tensor, spatial_shapes: Tensor, level_start_index: Tensor | None,
    num_queries: int, num_points: int,
) -> tuple:  # fmt: skip
    """What `fold_call` reads, as a key: two calls with equal keys get the same grid, integers,
    tensor dtypes and constexprs (tests/test_direct_launch.py checks it)."""
    return (
        grad_value.shape, grad_value.dtype, grad_value.device, replicas.shape, replicas.dtype,
        spatial_shapes.shape, spatial_shapes.dtype, None if level_start_index is None else level_start_index.dtype,
        num_queries, num_points, FOLD_TILE_ELEMENTS, FOLD_REPLICAS_A_PROGRAM, FOLD_UNROLL,
    )  # fmt: skip


LIST_QUERIES = 16  # queries a program of the sample lists' kernel
# Overrides of `list_rule` (bench.tune, tests): the gather's rows a program and list entries a
# run a step, the counters' spacing; None: the rule's.
LIST_ROWS: int | None = None
LIST_ENTRIES: int | None = None
LIST_COUNT_STRIDE: int | None = None
LIST_WARPS: int | None = None
LIST_JOINED: bool | None = None
LIST_SORTED: bool | None = None
# The backward kernel's tile where it leaves grad_value to the lists (bench.tune); None: `backward_config`.
LIST_BACKWARD: TileConfig | None = None


class ListRule(NamedTuple):
    rows: int  # rows a gather program
    entries: int  # entries of each of a row's two runs a step, side by side (not joined)
    count_stride: int  # int32 counters from one list's to the next
    warps: int  # a gather program's
    joined: bool  # a row's two runs one after the other, an entry a step, loaded a step ahead
    sorted_sums: bool  # lists sorted, then summed in float32 in their order (else 64-bit fixed point)


def list_rule(num_queries, num_values, value: Tensor) -> ListRule:
    """The deterministic mode's lists, from the H200's sweeps (bench/NOTES.md entries 37 to 43,
    graph replay us):

    - encoders: 4 rows a program on one warp, 2 entries a run in float32 (4 loads in flight a
      row), 4 in half precision: float32 1388 against 1393 at 4 entries and 2066 at 8 rows,
      bfloat16 1083 against 1128 at 2 entries and 1490 at 8 rows, float16 1060 against 1116
      (entry 39; 2 to 4 warps lost by 15-80% in entry 38);
    - decoders: a row's two runs joined, one after the other, an entry a step, loaded a step
      ahead (their lists are short and mostly empty: side by side, the runs took a step's work
      for each row as long as the longer run lasted), one warp, 32 rows a program: bfloat16 88.3
      against 91.5 at 16 rows and 105.3 side by side (the rule before), float16 83.1 against
      87.0 and 99.7, float32 101.1 at 16 and 32 rows against 114.4 side by side; 8 or 64 rows
      10-20% slower (entry 41). Side by side, 2 entries a step, 2 or 4 warps lost 3-55% (entry 39);
    - the counters of an encoder 32 bytes apart, a sector each: its coarse levels' pixels each take
      about 330 samples of a head, spread over more L2 slices (float32 encoder 1548 against 1693
      packed); a decoder's packed (178 against 189 us: less to zero, and few collide);
    - a decoder's lists sorted, then summed in float32 in their order; an encoder's summed in
      64-bit fixed point. At the decoder preset the gather takes 30.6 us in float32 against 47-48
      in fixed point (bfloat16; float16 31.7 against 48.6, float32 43.4 against 63.0), no scale
      kernel (4.4 us), and the sort 2.5 us: the whole deterministic backward bfloat16 70.4-74.6
      against 88.0-89.0, float16 70.5-72.5 against 89.2-90.8, float32 81.7-82.7 against
      102.7-107.0 (graph replay, entry 43). An encoder's lists are hundreds of entries long on
      its coarse levels, n steps a slot to sort: the sort alone took 1.8 ms at the encoder
      preset (bfloat16), more than the whole fixed-point backward (1.08 ms, entry 39)."""
    encoder = every_pixel_a_query(num_queries, num_values)
    half = value.element_size() == 2
    rows = LIST_ROWS or (4 if encoder else 32)
    return ListRule(
        rows,
        LIST_ENTRIES or ((4 if half else 2) if encoder else 1),
        LIST_COUNT_STRIDE or (8 if encoder else 1),
        LIST_WARPS or (_gather_warps(rows, value.shape[-1], value) if encoder else 1),
        (not encoder) if LIST_JOINED is None else LIST_JOINED,
        (not encoder) if LIST_SORTED is None else LIST_SORTED,
    )


class ListBuffers(NamedTuple):
    """The deterministic mode's buffers that the backward kernel writes before the lists' kernels:
    `counters`, int32 zeros, the lists' counts (`list_rule`'s spacing) and then the fixed-point
    scale's two maxima and ticket; `weights`, each corner's weight (float32, float64 for float64
    inputs), holding each listed sample's rank in its list until the lists' kernel writes them."""

    counters: Tensor
    weights: Tensor


def list_buffers(value: Tensor, sampling_locations: Tensor, attention_weights: Tensor) -> ListBuffers:
    """For the deterministic mode: the counters, zeros, which the backward kernel counts into
    (`backward_call`), then `fixed_point_scales` (one zeroing for both), and the corner weights'
    array, where the backward kernel leaves each sample's rank in its list for the lists' kernel,
    which writes the weights over it (`deterministic_grad_value`)."""
    B, S, M, _ = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    rule = list_rule(Q, S, value)
    compute = compute_dtype(value, sampling_locations, attention_weights)
    # Zeroed without deterministic mode's fill of torch.zeros' empty tensor first: one pass, not
    # two (1.4 us at the decoder, 3.3 at the encoder; bench/NOTES.md entry 41).
    counters = empty_written_whole((B * M * S * rule.count_stride + 3,), torch.int32, value.device)
    weights = empty_written_whole((B * Q * M * L * K * 4,), torch.float64 if compute == tl.float64 else torch.float32,
                                  value.device)  # fmt: skip
    return ListBuffers(counters.zero_(), weights)


def deterministic_grad_value(
    launch,
    buffers: ListBuffers,
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor | None,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    """The deterministic mode's grad_value by kernels/deterministic.py's launches, each made by
    `launch(kernel, grid, args, constexprs)` (the operator's through wrap_triton, the eager path's
    directly); tensors as for `backward_call`, the weights not logits; `buffers` as the backward
    kernel left them, every list counted and every sample's rank in it (`list_buffers`). Where
    the rule sorts the lists (`ListRule.sorted_sums`), the gather sums them in float32; else in
    64-bit fixed point at `backward.fixed_point_scale`'s scale, computed by a kernel of its own."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    L, K, M, D = int(L), int(K), int(M), int(D)
    device = value.device
    samples = B * Q * M * L * K
    index_64 = needs_int64(value, sampling_locations, grad_output) or samples * 4 >= 2**31
    compute = compute_dtype(value, sampling_locations, attention_weights)
    num_lists = B * M * S  # one a pixel of each batch and head
    rule = list_rule(Q, S, value)
    counts, maxima = buffers.counters[:-3], buffers.counters[-3:]
    weights = buffers.weights
    index_dtype = torch.int64 if index_64 else torch.int32
    with fill_skipped():  # each written before it is read (the NaN fill would cost a pass each)
        entries = torch.empty((samples,), dtype=index_dtype, device=device)
        grad_value = torch.empty(value.shape, dtype=value.dtype, device=device)
        listed = torch.empty_like(entries) if rule.sorted_sums else entries  # the lists sorted into it
        slot_lists = torch.empty_like(entries) if rule.sorted_sums else entries  # (unwritten if not sorted)
    scales = weights if rule.sorted_sums else fixed_point_scales(launch, grad_output, attention_weights, Q * L * K,
                                                                 maxima)  # (unread if sorted)  # fmt: skip
    starts = spatial_shapes if level_start_index is None else level_start_index  # unread if None
    lists = dict(
        NUM_HEADS=M,
        NUM_LEVELS=L,
        NUM_POINTS=K,
        BLOCK_Q=LIST_QUERIES,
        BLOCK_K=_next_power_of_2(K),
        COMPUTE=compute,
        INDEX_64=index_64,
        LEVEL_STARTS=level_start_index is not None,
        SLOT_LISTS=rule.sorted_sums,
        num_warps=max(1, min(8, LIST_QUERIES * _next_power_of_2(K) // 32)),
    )
    grid = (_cdiv(Q, LIST_QUERIES) * B * M,)
    # Slots as int32 where every index fits: cheaper index arithmetic in the gather.
    ends = counts[:: rule.count_stride].cumsum(0, dtype=index_dtype)
    launch(msda_sample_lists_kernel, grid, (spatial_shapes, starts, sampling_locations, attention_weights, ends,
                                            entries, slot_lists, weights, Q, S), lists)  # fmt: skip
    if rule.sorted_sums and num_lists > 0 and samples > 0:
        launch(msda_sort_lists_kernel, (_cdiv(samples, SORT_BLOCK),), (ends, entries, listed, slot_lists, num_lists),
               dict(BLOCK=SORT_BLOCK, AHEAD=SORT_AHEAD, INDEX_64=index_64, num_warps=SORT_WARPS))  # fmt: skip
    gather = dict(
        NUM_HEADS=M,
        HEAD_DIM=D,
        NUM_LEVELS=L,
        NUM_POINTS=K,
        ROWS=rule.rows,
        ENTRIES=rule.entries,
        BLOCK_D=_next_power_of_2(D),
        INDEX_64=index_64 or needs_int64(grad_value),
        LEVEL_STARTS=level_start_index is not None,
        BATCHES_FOLLOW=grad_output.stride(0) == Q * grad_output.stride(1),
        BLOCK_L=_next_power_of_2(L),
        ROWS_ALIGNED=grad_output.stride(0) % 16 == 0 and grad_output.stride(1) % 16 == 0,
        JOINED=rule.joined,
        SORTED_SUMS=rule.sorted_sums,
        num_warps=rule.warps,
    )
    args = (grad_output, grad_output.stride(0), grad_output.stride(1), spatial_shapes, starts, ends, listed, weights,
            scales, grad_value, Q, S, num_lists)  # fmt: skip
    if num_lists > 0:
        launch(msda_gather_grad_value_kernel, (B * M * _cdiv(S, rule.rows),), args, gather)
    return grad_value


# `msda_sort_lists_kernel`'s slots a program, entries a slot compares with a step, and warps.
SORT_BLOCK = 128
SORT_AHEAD = 4
SORT_WARPS = 4

SCALE_BLOCK = 4096  # elements of grad_output and of the weights a program of `msda_fixed_point_scale_kernel`


def fixed_point_scales(
    launch, grad_output: Tensor, attention_weights: Tensor, samples_per_row, maxima: Tensor
) -> Tensor:
    """float32 (2,): `backward.fixed_point_scale`'s 2**e and 2**-e, by one launch of
    `msda_fixed_point_scale_kernel` through `launch`; maxima: int32 (3,) zeros for it."""
    scales = empty_written_whole((2,), torch.float32, grad_output.device)  # (written whole: no NaN fill)
    numel = max(grad_output.numel(), attention_weights.numel())
    launch(msda_fixed_point_scale_kernel, (_cdiv(numel, SCALE_BLOCK),),
           (grad_output, grad_output.stride(0), grad_output.stride(1), grad_output.shape[1], grad_output.shape[2],
            grad_output.numel(), attention_weights, attention_weights.numel(), maxima, scales, samples_per_row),
           dict(FIXED_POINT_BITS=FIXED_POINT_BITS, BLOCK=SCALE_BLOCK,
                INDEX_64=needs_int64(grad_output, attention_weights)))  # fmt: skip
    return scales


def _gather_warps(rows: int, head_dim: int, value: Tensor) -> int:
    """Warps of a gather program: 16 bytes of a row's grad_value a thread."""
    return max(1, min(8, rows * _next_power_of_2(head_dim) * value.element_size() // 16 // 32))


def empty_written_whole(shape, dtype: torch.dtype, device) -> Tensor:
    """torch.empty for a buffer a kernel writes every element of: without the NaN fill of
    deterministic mode (a pass over it: 12 us for the float32 encoder's forward output, entry
    38), and without `fill_skipped`'s context manager where that fill is off (most calls)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        with fill_skipped():
            return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_empty_written_whole(tensor: Tensor, shape=None) -> Tensor:
    """`empty_written_whole` of `shape` (None: `tensor`'s), contiguous, with `tensor`'s dtype and
    device, for the eager path: through `torch.empty_like` or `Tensor.new_empty`, which take those
    from `tensor` in C++ where torch.empty parses them from Python arguments (on an H200 host, a
    decoder's value-sized buffer: torch.empty 8.1 us a call, empty_like 3.7, new_empty 5.8;
    bench/NOTES.md entry 71)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        with fill_skipped():
            return new_empty_written_whole(tensor, shape)
    if shape is None:
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return tensor.new_empty(shape)


@contextlib.contextmanager
def fill_skipped(skip: bool = True):
    """torch.empty inside it without the NaN fill of deterministic mode
    (torch.utils.deterministic.fill_uninitialized_memory), where `skip`: for buffers the kernels
    write whole or read only where written. A traced call's graph allocates later, with the fill."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    if not (skip and fill):
        yield
        return
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True
