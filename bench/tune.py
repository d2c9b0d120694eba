"""Sweep the kernels' launch settings at the presets of docs/benchmarking.md.

    python -m bench.tune [--presets decoder encoder] [--dtypes float32 float16 bfloat16]
                         [--dists uniform local] [--kernels fwd bwd]
                         [--forward 16,2,0 8,2,0 ...] [--backward 4,4,0 ...] [--float32-params]
                         [--lists 4,2 8,2,1 16,2,1,1 ...] [--fresh-buffers]

Each variant is a msda.kernels.launch.TileConfig (block_q,groups,threads_per_row[,unroll_levels
[,prefetch[,bf16_pairs[,lane_placement[,lane_unroll[,max_registers[,params_ahead]]]]]]]; threads_per_row 0 reads a
whole row per load; any field also as name=value after the positional ones, e.g.
16,2,0,lane_placement=1,lane_unroll=2,max_registers=40, which keeps its meaning when TileConfig
gains a field), launched explicitly
through the same argument builders as the operator: nothing in msda is patched. Device time by
CUDA-graph replay of the kernel launches (the backward's zeroing of grad_value included), every
variant's output checked against the float64 reference in the same run, and the peer deformops
beside it when importable. bench/NOTES.md logs what the sweeps chose.

--lists times the deterministic mode's backward (kernels/deterministic.py) at each gather tile
ROWS,ENTRIES[,COUNT_STRIDE[,WARPS[,JOINED[,SORTED]]]] (launch.LIST_ROWS, launch.LIST_ENTRIES,
launch.LIST_COUNT_STRIDE, launch.LIST_WARPS: a gather program's warps, launch.LIST_JOINED: 1 to
walk a row's two runs one after the other, an entry a step loaded a step ahead, ENTRIES unread;
0 side by side; launch.LIST_SORTED: 1 to sort the lists and sum them in float32, 0 to sum them
in 64-bit fixed point; the rule's
where not given), against the
default atomic backward and the 64-bit atomic fixed-point path it replaces, each checked against
the float64 reference; --lists-backward times it at the first --lists tile with its backward kernel
(which leaves grad_value to the lists) at each forward-style tile given (launch.LIST_BACKWARD).

--ncu launches each variant once between cudaProfilerStart and cudaProfilerStop instead of
timing it, for Nsight Compute's counters (bench/NOTES.md entry 26 read these):

    ncu --profile-from-start off --clock-control none -k regex:msda --csv --page details \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section SchedulerStats \
        --metrics smsp__inst_executed.sum,lts__t_sectors_srcunit_tex.sum,l1tex__t_sector_hit_rate.pct \
        python -m bench.tune --ncu --kernels fwd --presets encoder --dtypes float32 --forward 16,2,0,0,1

ncu flushes the caches before each replay of a kernel unless told not to. For a backward as it
runs, straight after its fill of grad_value (what the L2 then holds is most of the story), add
`--cache-control none`: the first replay pass sees that L2, later ones what the kernel left
(bench/NOTES.md entry 58 read the float32 decoder's that way, with the counters
lts__t_sectors_srcunit_tex_op_red.sum, lts__t_sector_op_read_hit_rate.pct,
lts__t_sector_op_red_hit_rate.pct, dram__bytes_read.sum and the SchedulerStats section).
"""

from __future__ import annotations

import argparse

import torch

from msda.kernels import launch
from msda.kernels.backward import (
    fixed_point_scale,
    from_fixed_point,
    grad_value_accumulator_dtype,
    msda_backward_kernel,
    msda_fold_replicas_kernel,
    replica_rows,
    zero_,
)
from msda.kernels.forward import msda_forward_kernel
from msda.testing import PRESETS, make_inputs, reference, reference_with_grads, relative_error

from .timing import graph_device_time
from .variants import DISTS, DTYPES, Unavailable, deformops_msda

T = launch.TileConfig
FORWARD_SWEEP = [T(16, 2, 0), T(8, 2, 0), T(32, 2, 0), T(16, 1, 0), T(8, 4, 0), T(16, 2, 0, 16), T(16, 1, 2)]
BACKWARD_SWEEP = [T(4, 4, 0), T(2, 4, 0), T(8, 2, 0), T(4, 1, 0), T(16, 1, 0)]


def forward_launch(inputs, tile: launch.TileConfig):
    """(a callable launching the forward kernel with `tile`, its output buffer)."""
    value, shapes, starts, loc, attn = inputs.args()
    B, _, M, D = value.shape
    out = value.new_empty(B, loc.shape[1], M * D)
    grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out, tile)
    return lambda: msda_forward_kernel[grid](*args, **constexprs), out


def backward_launch(inputs, grad_output, tile: launch.TileConfig, accumulator: torch.dtype | None = None,
                    replicas: bool | None = None, fresh: bool = False):
    """(a callable zeroing grad_value and launching the backward kernel with `tile`, then the fold
    of the replicas, its three gradient buffers); grad_value accumulates in `accumulator`, with
    replicas of the dense levels or without (default: the operator's rules).

    fresh: each call zeroes a grad_value (and replicas) of its own, as the operator's calls do:
    captured in a graph, each call then has its own memory, as in the bench's graph replay.
    Otherwise every call reuses one set, whose lines the call before leaves in the L2: a change
    to what the L2 keeps can win there and lose with fresh buffers (bench/NOTES.md entry 56).
    The list returned holds the last call's buffers."""
    value, shapes, starts, loc, attn = inputs.args()
    B, S, M, D = value.shape
    Q, L, K = loc.shape[1], loc.shape[3], loc.shape[4]
    accumulator = accumulator or grad_value_accumulator_dtype(value, Q, L, K)
    rows = None if replicas is False else replica_rows(accumulator, Q, S, L, K, force=bool(replicas))
    grads = [None, torch.empty_like(loc), torch.empty_like(attn)]

    def buffers():
        """New grad_value and replicas in `grads`, and the launches that sum into them."""
        grads[0] = torch.empty(value.shape, dtype=accumulator, device=value.device)
        copies = None if rows is None else torch.empty(B, rows, M, D, dtype=accumulator, device=value.device)
        call = launch.backward_call(grad_output, value, shapes, starts, loc, attn, *grads, tile, replicas=copies)
        fold = None if copies is None else launch.fold_call(grads[0], copies, shapes, starts, Q, K)
        return copies, call, fold

    reused = buffers()

    def run():
        copies, (grid, args, constexprs), fold = buffers() if fresh else reused
        zero_(grads[0])  # as the operator zeroes it
        if copies is not None:
            zero_(copies)
        msda_backward_kernel[grid](*args, **constexprs)
        if fold is not None:
            fold_grid, fold_args, fold_constexprs = fold
            msda_fold_replicas_kernel[fold_grid](*fold_args, **fold_constexprs)

    return run, grads


def _set_list_overrides(tile: tuple[int, ...]) -> None:
    """launch.LIST_* from a --lists tile; the rule's where the tile stops short."""
    (launch.LIST_ROWS, launch.LIST_ENTRIES, launch.LIST_COUNT_STRIDE, launch.LIST_WARPS,
     joined, sorted_sums) = (*tile, None, None, None, None)[:6]  # fmt: skip
    launch.LIST_JOINED = None if joined is None else bool(joined)
    launch.LIST_SORTED = None if sorted_sums is None else bool(sorted_sums)


def deterministic_launch(inputs, grad_output, tile: tuple[int, ...] | None):
    """(a callable running the deterministic mode's backward, the three gradients it last gave):
    tile (rows, entries[, count stride[, warps[, joined[, sorted]]]]): the lists at that gather tile, its
    overrides set for the launches built here and left set; None: the 64-bit atomic fixed-point
    path (an int64 grad_value zeroed, added into, converted)."""
    value, shapes, starts, loc, attn = inputs.args()
    Q, L, K = loc.shape[1], loc.shape[3], loc.shape[4]
    scale = fixed_point_scale(grad_output, attn, Q * L * K)
    grads = [None, torch.empty_like(loc), torch.empty_like(attn)]
    fixed = torch.zeros(value.shape, dtype=torch.int64, device=value.device) if tile is None else None
    if tile is not None:  # the tile's counter spacing for the backward kernel's counts too
        _set_list_overrides(tile)
    lists = None if tile is None else launch.list_buffers(value, loc, attn)
    grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, fixed, *grads[1:],
                                                  fixed_point_scale=scale, lists=lists)  # fmt: skip

    def run():
        if tile is None:
            fixed.zero_()
        else:  # as the operator allocates them: zeros each call
            lists.counters.zero_()
        msda_backward_kernel[grid](*args, **constexprs)
        if tile is None:
            grads[0] = from_fixed_point(fixed, scale, value.dtype)
            return
        grads[0] = launch.deterministic_grad_value(
            lambda kernel, grid, args, constexprs: kernel[grid](*args, **constexprs),
            lists, grad_output, value, shapes, starts, loc, attn,
        )  # fmt: skip

    return run, grads


def profile_once(inputs, opts, dtype: torch.dtype) -> None:
    """Each forward and backward variant launched once inside cudaProfilerStart/Stop (after a
    launch outside it that compiles), for ncu --profile-from-start off."""
    runs = [forward_launch(inputs, tile)[0] for tile in opts.forward] if "fwd" in opts.kernels else []
    if "bwd" in opts.kernels:
        B, Q, M, D = inputs.value.shape[0], inputs.sampling_locations.shape[1], *inputs.value.shape[2:]
        grad = torch.randn(B, Q, M * D, device="cuda").to(dtype)
        runs += [backward_launch(inputs, grad, tile)[0] for tile in opts.backward]
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _tiles(text: str) -> launch.TileConfig:
    """A TileConfig from "Q,G,T[,more fields in order][,name=value ...]". Positional fields mean
    what TileConfig's order says today, so a string kept from an older sweep changes meaning when
    a field is added before its last one (bench/NOTES.md entry 31 lost a run to that); the named
    form does not."""
    positional, named = [], {}
    try:
        for item in text.split(","):
            name, sep, value = item.partition("=")
            if not sep:
                if named:
                    raise ValueError("a positional value after a named one")
                positional.append(int(item))
            elif name in T._fields:
                named[name] = int(value)
            else:
                raise ValueError(f"no field {name!r} (TileConfig has {', '.join(T._fields)})")
        return T(*positional, **named)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _list_tile(text: str) -> tuple[int, ...]:
    try:
        tile = tuple(int(n) for n in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) not in (2, 3, 4, 5, 6) or min(tile[:4]) < 1 or any(flag not in (0, 1) for flag in tile[4:]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected ROWS,ENTRIES[,COUNT_STRIDE[,WARPS[,JOINED 0|1[,SORTED 0|1]]]]"
        )
    return tile


def _name(tile: launch.TileConfig) -> str:
    return ",".join(str(n) for n in tile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["decoder", "encoder"], choices=sorted(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--dists", nargs="+", default=["uniform"], choices=DISTS)
    parser.add_argument("--kernels", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--forward", nargs="+", type=_tiles, default=FORWARD_SWEEP, metavar="Q,G,T[,...]")
    parser.add_argument("--backward", nargs="+", type=_tiles, default=BACKWARD_SWEEP, metavar="Q,G,T")
    parser.add_argument("--lists", nargs="+", type=_list_tile, default=[],
                        metavar="ROWS,ENTRIES[,STRIDE[,WARPS[,JOINED[,SORTED]]]]",
                        help="time the deterministic backward at these gather tiles")  # fmt: skip
    parser.add_argument("--lists-backward", nargs="+", type=_tiles, default=[], metavar="Q,G,T[,...]",
                        help="and at the first --lists tile, its backward kernel at these tiles")
    parser.add_argument("--ncu", action="store_true", help="launch each variant once for ncu, time nothing")
    parser.add_argument("--fresh-buffers", action="store_true",
                        help="the backward: a grad_value of its own each call, as the bench's graph replay "
                             "(default: one reused, NOTES entry 56)")  # fmt: skip
    parser.add_argument("--float32-params", action="store_true",
                        help="float32 locations and weights with half-precision values (default: the "
                             "value's dtype, as the bench and most models; NOTES entry 25)")  # fmt: skip
    opts = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (graph replay, µs; relative error)")
    try:
        peer = deformops_msda()
    except Unavailable as e:
        peer = None
        print(e)
    for preset in opts.presets:
        for dist in opts.dists:
            for dtype_name in opts.dtypes:
                dtype = DTYPES[dtype_name]
                loc_dtype = torch.float32 if opts.float32_params else dtype
                inputs = make_inputs(PRESETS[preset], dtype, "cuda", loc_dtype=loc_dtype, dist=dist, seed=3)
                cell = f"{preset} {dist} {dtype_name}"
                if opts.ncu:
                    profile_once(inputs, opts, dtype)
                elif "fwd" in opts.kernels:
                    expected = reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations,
                                         inputs.attention_weights)  # fmt: skip
                    line = []
                    for tile in opts.forward:
                        run, out = forward_launch(inputs, tile)
                        t = graph_device_time(run)
                        line.append(f"{_name(tile)}: {t.median_us:.1f} ({relative_error(out, expected):.0e})")
                    if peer is not None:  # the peer takes one float dtype for all inputs
                        args = [a.to(dtype) if a.is_floating_point() else a for a in inputs.args()]
                        line.append(f"deformops: {graph_device_time(lambda: peer(*args)).median_us:.1f}")
                    print(f"fwd {cell} | " + "  ".join(line), flush=True)
                if "bwd" in opts.kernels and not opts.ncu:
                    Q, M, D = PRESETS[preset].queries, PRESETS[preset].heads, PRESETS[preset].head_dim
                    grad = torch.randn(inputs.value.shape[0], Q, M * D, device="cuda").to(dtype)
                    expected = reference_with_grads(inputs, grad)[1:]
                    line = []
                    for tile in opts.backward:
                        run, grads = backward_launch(inputs, grad, tile, fresh=opts.fresh_buffers)
                        t = graph_device_time(run, calls=10, replays=5)
                        worst = max(relative_error(g, r) for g, r in zip(grads, expected))
                        line.append(f"{_name(tile)}: {t.median_us:.1f} ({worst:.0e})")
                    print(f"bwd {cell} | " + "  ".join(line), flush=True)
                if opts.lists and not opts.ncu:
                    Q, M, D = PRESETS[preset].queries, PRESETS[preset].heads, PRESETS[preset].head_dim
                    grad = torch.randn(inputs.value.shape[0], Q, M * D, device="cuda").to(dtype)
                    expected = reference_with_grads(inputs, grad)[1:]
                    # The atomic backward at its rule's tile (the half encoders' 2 queries a program too).
                    encoder = launch.every_pixel_a_query(Q, inputs.value.shape[1])
                    run, _ = backward_launch(
                        inputs, grad, launch.backward_config(4, 4, D, dtype, encoder), fresh=opts.fresh_buffers
                    )
                    line = [f"atomic: {graph_device_time(run, calls=10, replays=5).median_us:.1f}"]
                    overrides = (launch.LIST_ROWS, launch.LIST_ENTRIES, launch.LIST_COUNT_STRIDE, launch.LIST_WARPS,
                                 launch.LIST_JOINED, launch.LIST_SORTED)  # fmt: skip
                    for tile in [None, *opts.lists]:
                        run, grads = deterministic_launch(inputs, grad, tile)
                        t = graph_device_time(run, calls=10, replays=5)
                        run()
                        worst = max(relative_error(g, r) for g, r in zip(grads, expected))
                        name = "int64 atomics" if tile is None else "lists " + "x".join(map(str, tile))
                        line.append(f"{name}: {t.median_us:.1f} ({worst:.0e})")
                    for backward_tile in opts.lists_backward:  # at the first --lists tile
                        launch.LIST_BACKWARD = backward_tile
                        run, grads = deterministic_launch(inputs, grad, opts.lists[0])
                        t = graph_device_time(run, calls=10, replays=5)
                        run()
                        worst = max(relative_error(g, r) for g, r in zip(grads, expected))
                        line.append(f"backward {_name(backward_tile)}: {t.median_us:.1f} ({worst:.0e})")
                    launch.LIST_BACKWARD = None
                    (launch.LIST_ROWS, launch.LIST_ENTRIES, launch.LIST_COUNT_STRIDE, launch.LIST_WARPS,
                     launch.LIST_JOINED, launch.LIST_SORTED) = overrides  # fmt: skip
                    print(f"deterministic {cell} | " + "  ".join(line), flush=True)
                del inputs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
