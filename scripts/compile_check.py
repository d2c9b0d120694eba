"""Compile both kernels for sm_90 (Hopper) with the installed triton, at the launch settings the
operator picks, across dtypes, (L, K, D), index widths and int64 / int32 spatial shapes, each with
and without the softmax of the attention logits (SOFTMAX: msda::forward_softmax and
msda::backward_softmax). No GPU needed: triton's own ptxas runs here. Run it without
TRITON_INTERPRET (interpreted kernels cannot be compiled).

    python scripts/compile_check.py [--full | --preset | --rocm]

Triton's compiler has crashed on tile shapes in one release and not in another (bench/NOTES.md,
entries 2, 8, 10, 12): only a compile shows that, never the interpreter. The kernels' arguments
come from the same builders the operator launches with (msda/kernels/launch.py), on small CPU
tensors of each dtype, so the signatures here cannot drift from the kernels'.

It also checks:
- torch.compile's analysis of which arguments each kernel writes (over the kernel's TTIR, as
  functionalization does): it must name the outputs alone. Were it to name an input, compiled
  graphs would clone that input around every launch and copy the clone back over it
  (bench/NOTES.md, entry 9);
- the layouts of the kernels' lane placement (`sampling.from_lane`, `launch.LANE_AXIS`): its
  gathers along the tile's lane axis are right in any layout, but fast only where that axis lies
  over consecutive lanes of a warp (one shuffle each, Triton's `efficient_layout`) and where the
  tile keeps one layout through the loops (no exchange through shared memory, no barrier, in
  them). Triton picks layouts itself, and releases break ties between axes differently (3.6
  otherwise than 3.7 and 3.8): a release or a change that slows the loop so fails here, not in
  a benchmark.
  Where the placements go by PTX shuffles instead (`launch.SHUFFLE`, triton 3.6), they pass a
  value from lane k of each segment of LANES consecutive lanes, so the tensor they act on must
  lay its lane axis over exactly those lanes: the check reads that from the TTGIR too, as a
  release that picked another would give wrong results;
- compile time: models with 8 levels or 8 points sit at L * K = 32 to 64, and a first call
  that compiles for a minute looks like a hang. Each kernel at L * K = 128 must compile within
  COMPILE_SECONDS here (a generous bound for a busy two-core machine; about 1 s on one core);
- integer arguments as constants: torch.compile's generated code passes a kernel's integer
  arguments whose values it knows (static shapes) as constexprs, so in the kernel they are
  Python ints, not tensors (`n.to(...)` then fails to compile: bench/NOTES.md entry 38 lost a
  device call to it). At the preset every kernel compiles that way too;
- float64 placement: the product x * size rounded before the pixel centre's 0.5 comes off, as
  the float64 reference does (`float64_placement_errors`; triton 3.8 fused it: entry 106);
- torch.compile's copies of the kernels' sources: every name they use defined in the copy
  (`inductor_copy_errors`);
- the shared tile (Gluon, where the installed release takes it): its one allocation all the
  shared memory the compiled kernel has, since its inline PTX addresses the tile from
  `global_smem` (`shared_tile_allocation_errors`).

With --rocm: the preset's kernels, every dtype, for an AMD GPU (gfx942, CDNA3) as a ROCm build
of torch would launch them (msda picks some kernel forms at import from `torch.version.hip`,
which this sets first): a ROCm user's compile, whose failures no other check here sees (one
libdevice function CUDA has and ROCm lacks, imported at a kernel module's top, failed every
kernel there: bench/NOTES.md entry 106). Layout, PTX and torch.compile write checks are CUDA's.

Prints each failure and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import builtins
import dis
import importlib.util
import itertools
import os
import pathlib
import re
import sys
import tempfile
import time
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")

import torch  # noqa: E402

ROCM = "--rocm" in sys.argv[1:]
if ROCM:  # before msda's import, which reads it
    torch.version.hip = "6.4"
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from msda.kernels import launch  # noqa: E402
from msda.kernels.backward import msda_backward_kernel, msda_fold_replicas_kernel  # noqa: E402
from msda.kernels.deterministic import (  # noqa: E402
    msda_fixed_point_scale_kernel,
    msda_gather_grad_value_kernel,
    msda_sample_lists_kernel,
    msda_sort_lists_kernel,
)
from msda.kernels.forward import msda_forward_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
CDNA3 = GPUTarget("hip", "gfx942", 64)
# value, locations/weights and grad_value accumulator dtypes
DTYPES = {
    "float32": (torch.float32, torch.float32, torch.float32),
    "float16": (torch.float16, torch.float32, torch.float16),
    "bfloat16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "float64": (torch.float64, torch.float64, torch.float64),
}
# The preset, and shapes that crashed triton 3.6 once (bench/NOTES.md entries 8, 10 and 12).
QUICK_SHAPES = [(4, 4, 32), (3, 2, 24), (3, 3, 24), (1, 1, 64), (4, 2, 96)]
FULL_SHAPES = [(L, K, D) for L in (1, 3, 4) for K in (1, 2, 4, 8) for D in (1, 3, 8, 24, 32, 48, 64, 96, 256)]
# L * K = 128 both ways round, float32 and bfloat16 (its packed forward); and 16 levels of one
# point, the most loop steps a rule that unrolls the level loop at L * K <= 16 would unroll
# (bfloat16's did for a while: 6.5 s here, bench/NOTES.md entry 23).
TIMED_SHAPES = [(4, 32, 32), (8, 16, 32), (16, 1, 32)]
COMPILE_SECONDS = 60.0
LAUNCH_OPTIONS = ("num_warps", "maxnreg")  # in a call's constexprs, compile options rather than arguments
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                torch.int32: "i32", torch.int64: "i64"}
# What torch.compile must see each kernel write: (kernel, softmax) -> argument names; a
# backward with REPLICAS writes replica_ptr besides.
OUTPUTS = {("msda_forward_kernel", False): ["out_ptr"],
           ("msda_forward_kernel", True): ["out_ptr"],
           ("msda_backward_kernel", False): ["grad_value_ptr", "grad_loc_ptr", "grad_attn_ptr"],
           ("msda_backward_kernel", True): ["grad_value_ptr", "grad_loc_ptr", "grad_attn_ptr", "scratch_ptr"],
           ("msda_fold_replicas_kernel", False): ["grad_value_ptr"],
           ("msda_fold_replicas_kernel", True): ["grad_value_ptr"]}


def outputs(kernel, constexprs: dict, softmax: bool) -> list[str]:
    if kernel is msda_sample_lists_kernel:  # counting, then listing
        return sorted(["entries_ptr", "weights_ptr"] + (["slot_lists_ptr"] if constexprs["SLOT_LISTS"] else []))
    if kernel is msda_sort_lists_kernel:
        return ["sorted_ptr"]
    if kernel is msda_gather_grad_value_kernel:
        return ["grad_value_ptr"]
    if kernel is msda_fixed_point_scale_kernel:
        return ["maxima_ptr", "scales_ptr"]
    written = OUTPUTS[kernel.__name__, softmax] + (["replica_ptr"] if constexprs.get("REPLICAS") else [])
    if constexprs.get("GRAD_VALUE") is False:  # the deterministic mode's lists sum grad_value
        written.remove("grad_value_ptr")
    if constexprs.get("COUNT_STRIDE"):  # and the backward counts their samples, leaving their ranks
        written += ["counts_ptr", "list_ranks_ptr"]
    if constexprs.get("FOLD_PIXELS"):  # the programs of each (batch, head) count themselves done
        written += ["counts_ptr"]
    return sorted(written)


def kernel_calls(
    levels: int, points: int, head_dim: int, dtype: str, index_64: bool, index: torch.dtype, softmax: bool = False,
    fixed_point: bool = True, fixed_point_lists: bool = False,
):
    """(kernel, positional arguments, constexprs) of the forward and the backward, as the
    operator builds them, on tiny CPU tensors; softmax: the softmax operators' calls (the
    backward with a scratch of its own, as msda::backward_softmax passes it), the backward with
    replicas of dense levels and the kernel folding them; fixed_point: the deterministic mode's
    backward too (int64 grad_value; not for float64, which never runs it), its lists as the rule
    takes them at this (decoder's) shape: sorted, summed in float32; fixed_point_lists: summed in
    fixed point besides (launch.LIST_SORTED=False: the scale kernel, the gather's integer sums),
    and an encoder's lists (every pixel a query: the rule's fixed point at its own tile)."""
    value_dtype, loc_dtype, accumulator = DTYPES[dtype]
    B, S, M, Q = 1, 3, 2, 2
    value = torch.zeros(B, S, M, head_dim, dtype=value_dtype)
    shapes = torch.ones(levels, 2, dtype=index)
    starts = torch.zeros(levels, dtype=index)
    loc = torch.zeros(B, Q, M, levels, points, 2, dtype=loc_dtype)
    attn = torch.zeros(B, Q, M, levels, points, dtype=loc_dtype)
    out = torch.zeros(B, Q, M * head_dim, dtype=value_dtype)
    grad_value = torch.zeros(value.shape, dtype=accumulator)
    scratch = torch.zeros(attn.shape, dtype=launch.softmax_scratch_dtype(value, loc, attn)) if softmax else None
    # The index width as a call on tensors past 2**31 elements would take it (the rule reads it),
    # and the register targets of a Hopper GPU.
    needs_int64, launch.needs_int64 = launch.needs_int64, lambda *tensors: index_64
    register_target, launch.register_target = launch.register_target, lambda device: not ROCM
    try:
        calls = [
            (msda_forward_kernel, *launch.forward_call(value, shapes, starts, loc, attn, out, softmax=softmax)[1:]),
            (msda_backward_kernel, *launch.backward_call(
                out, value, shapes, starts, loc, attn, grad_value, torch.zeros_like(loc), torch.zeros_like(attn),
                softmax=softmax, scratch=scratch,
            )[1:]),
        ]  # fmt: skip
        if value_dtype != torch.float64:  # the encoder's rules: every pixel a query (Q == S)
            every_pixel = [torch.zeros(B, S, *t.shape[2:], dtype=t.dtype) for t in (loc, attn, out)]
            calls.append((msda_forward_kernel, *launch.forward_call(value, shapes, starts, *every_pixel)[1:]))
            every_loc, every_attn, every_out = every_pixel
            every_scratch = None if scratch is None else torch.zeros(every_attn.shape, dtype=scratch.dtype)
            calls.append((msda_backward_kernel, *launch.backward_call(
                every_out, value, shapes, starts, every_loc, every_attn, grad_value, torch.zeros_like(every_loc),
                torch.zeros_like(every_attn), softmax=softmax, scratch=every_scratch,
            )[1:]))  # fmt: skip
            if dtype == "float32" and not softmax:  # the last level left to the shared tile (shared_tile.py)
                calls.append((msda_backward_kernel, *launch.backward_call(
                    every_out, value, shapes, starts, every_loc, every_attn, grad_value, torch.zeros_like(every_loc),
                    torch.zeros_like(every_attn), shared_tile=True,
                )[1:]))  # fmt: skip
        replicas = torch.zeros(B, 2, M, head_dim, dtype=accumulator)
        calls += [
            (msda_backward_kernel, *launch.backward_call(
                out, value, shapes, starts, loc, attn, grad_value, torch.zeros_like(loc), torch.zeros_like(attn),
                softmax=softmax, scratch=scratch, replicas=replicas,
            )[1:]),
            (msda_fold_replicas_kernel, *launch.fold_call(grad_value, replicas, shapes, starts, Q, points)[1:]),
            (msda_backward_kernel, *launch.backward_call(  # the replicas folded in the kernel
                out, value, shapes, starts, loc, attn, grad_value, torch.zeros_like(loc), torch.zeros_like(attn),
                softmax=softmax, scratch=scratch, replicas=replicas, fold_counts=torch.zeros(B, M, dtype=torch.int32),
            )[1:]),
        ]  # fmt: skip
        if fixed_point and dtype != "float64":
            calls.append((msda_backward_kernel, *launch.backward_call(
                out, value, shapes, starts, loc, attn, torch.zeros(value.shape, dtype=torch.int64),
                torch.zeros_like(loc), torch.zeros_like(attn), softmax=softmax, scratch=scratch,
                fixed_point_scale=torch.ones(1),
            )[1:]))  # fmt: skip
            if not softmax:  # the deterministic mode's lists: the backward without grad_value, and their kernels

                def record(kernel, grid, args, constexprs):
                    calls.append((kernel, args, constexprs))

                lists = launch.list_buffers(value, loc, attn)
                calls.append((msda_backward_kernel, *launch.backward_call(
                    out, value, shapes, starts, loc, attn, None, torch.zeros_like(loc), torch.zeros_like(attn),
                    lists=lists,
                )[1:]))  # fmt: skip
                launch.deterministic_grad_value(record, lists, out, value, shapes, starts, loc, attn)
                if fixed_point_lists:
                    launch.LIST_SORTED = False
                    try:
                        launch.deterministic_grad_value(record, lists, out, value, shapes, starts, loc, attn)
                    finally:
                        launch.LIST_SORTED = None
                    # An encoder's (every pixel a query): its counters' spacing, its gather's tile.
                    every_lists = launch.list_buffers(value, every_loc, every_attn)
                    calls.append((msda_backward_kernel, *launch.backward_call(
                        every_out, value, shapes, starts, every_loc, every_attn, None, torch.zeros_like(every_loc),
                        torch.zeros_like(every_attn), lists=every_lists,
                    )[1:]))  # fmt: skip
                    launch.deterministic_grad_value(
                        record, every_lists, every_out, value, shapes, starts, every_loc, every_attn
                    )
    finally:
        launch.needs_int64, launch.register_target = needs_int64, register_target
    return calls


def lane_placement_layout_errors(ttgir: str, ptx: str) -> list[str]:
    """How a lane-placed kernel's layouts miss what makes it fast: a gather along the lane axis
    that Triton could not lower to warp shuffles, or a barrier inside a loop (a layout exchanged
    through shared memory on every turn or round)."""
    errors = [f"a gather not warp-local: {line.strip()[:160]}" for line in ttgir.splitlines()
              if " tt.gather " in line and "efficient_layout" not in line]  # fmt: skip
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        header = re.match(r"^(\$L__BB\d+_\d+):.*Loop Header", line)
        if header:  # the loop: from its header to its last branch back
            back = re.compile(rf"\bbra(\.uni)?\s+{re.escape(header.group(1))};")
            end = max((j for j in range(i, len(lines)) if back.search(lines[j])), default=i)
            barriers = sum("bar.sync" in body for body in lines[i : end + 1])
            if barriers:
                errors.append(f"{barriers} barriers in the loop at {header.group(1)}")
    return errors


def float64_placement_errors(ptx: str) -> list[str]:
    """How a float64 kernel's sample placement misses the reference's rounding: a product fused
    with the -0.5 into one fma (sampling.pixel_cell; triton 3.8 fused `x * size + 0.0 - 0.5`),
    or a kernel that floors float64 coordinates without a mul.rn.f64 (no fma may fuse it)."""
    errors = [f"a product fused with -0.5: {line.strip()}" for line in ptx.splitlines()
              if re.search(r"\bfma\.rn\.f64\b.*0dBFE0000000000000;", line)]  # fmt: skip
    if "cvt.rmi.f64.f64" in ptx and "mul.rn.f64" not in ptx:
        errors.append("floors float64 coordinates with no mul.rn.f64")
    return errors


def shuffle_layout_errors(ttgir: str) -> list[str]:
    """How the tensors of the lane placement's warp shuffles miss the layout they need: axis 0 (the
    lane axis, of the segment's size) one element a thread, over the lowest lane bits of one warp."""
    layouts = {}
    for name, body in re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M):
        fields = re.findall(r"(\w+) = \[([\d, ]+)\]", body)
        layouts[name] = {key: [int(v) for v in values.split(",")] for key, values in fields}
    errors = []
    for c, shape, layout in re.findall(
        r'elementwise_inline_asm "shfl\.sync\.idx\.b32 [^"]*, (\d+), -1;".*?: tensor<([\dx]+)x\w+, (#\w+)>', ttgir
    ):
        segment, lanes = 32 - (int(c) >> 8), int(shape.split("x")[0])
        if segment == lanes == 1:  # a thread's own value: no lanes to get wrong
            continue
        blocked = layouts.get(layout)
        if blocked is None:
            errors.append(f"a shuffle on {layout}, not a blocked layout")
            continue
        tpw, order = blocked["threadsPerWarp"], blocked["order"]
        below = order[: order.index(0)]  # axes on lower lane bits than axis 0
        if not (segment == lanes == tpw[0] and blocked["sizePerThread"][0] == 1 and blocked["warpsPerCTA"][0] == 1
                and all(tpw[axis] == 1 for axis in below)):  # fmt: skip
            errors.append(f"a shuffle of {segment}-lane segments on tensor<{shape}> in {blocked}")
    return errors


def signature(kernel, args: tuple, constexprs: dict) -> dict:
    types = {
        name: "i32" if isinstance(a, int) else "*" + TRITON_TYPES[a.dtype] for name, a in zip(kernel.arg_names, args)
    }
    return {**types, **{name: "constexpr" for name in constexprs if name not in LAUNCH_OPTIONS}}


def compile_for(
    kernel, args: tuple, constexprs: dict, timed: bool = False, constant_ints: bool = False, source_type=ASTSource,
    target: GPUTarget = HOPPER,
) -> tuple[float, object]:
    """Compile for `target` (sm_90; CDNA3 for ROCm's compile, with no PTX to check) as a launch
    with these arguments would (16-byte-aligned pointers), or with `constant_ints` as
    torch.compile's code would with static shapes (every integer argument a constexpr); returns
    (the seconds it took, the compiled kernel). source_type: GluonASTSource for a Gluon kernel."""
    if constant_ints:
        ints = {name: a for name, a in zip(kernel.arg_names, args) if isinstance(a, int)}
        constexprs = {**constexprs, **ints}
    values = {k: v for k, v in constexprs.items() if k not in LAUNCH_OPTIONS}
    pointers = [name for name, a in zip(kernel.arg_names, args) if not isinstance(a, int)]
    source = source_type(
        kernel,
        signature(kernel, args, constexprs),
        constexprs={(kernel.arg_names.index(k),): v for k, v in values.items()},
        attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers},
    )
    start = time.perf_counter()
    with triton.knobs.compilation.scope():
        triton.knobs.compilation.always_compile = timed  # a cached kernel would time nothing
        options = {k: v for k, v in constexprs.items() if k in LAUNCH_OPTIONS}
        compiled = triton.compile(source, target=target, options=options)
    seconds = time.perf_counter() - start
    if target is not HOPPER:
        return seconds, compiled
    errors = float64_placement_errors(compiled.asm["ptx"])
    if errors:
        raise AssertionError(f"float64 placement rounded unlike the reference ({len(errors)}): {errors[0]}")
    if constexprs.get("LANE_PLACEMENT"):
        if constexprs.get("SHUFFLE"):
            errors = shuffle_layout_errors(compiled.asm["ttgir"])
            if errors:
                raise AssertionError(f"{len(errors)} warp shuffles in the wrong layout: {errors[0]}")
        errors = lane_placement_layout_errors(compiled.asm["ttgir"], compiled.asm["ptx"])
        if errors:
            raise AssertionError(f"the lane placement laid out slowly ({len(errors)}): {errors[0]}")
    return seconds, compiled


def written_arguments(kernel, args: tuple, constexprs: dict) -> list[str]:
    """The arguments torch.compile believes `kernel` writes, from its TTIR for sm_90. On an
    analysis error torch assumes every tensor is written: that fails the check too."""
    from torch._higher_order_ops import triton_kernel_wrap

    kwargs = dict(zip(kernel.arg_names, args))
    kwargs.update({k: v for k, v in constexprs.items() if k not in LAUNCH_OPTIONS})
    driver = triton.runtime.driver
    previous = driver._active  # reset_active() would look for a GPU driver, and there may be none
    driver.set_active(SimpleNamespace(get_current_target=lambda: HOPPER))
    try:
        if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # torch >= 2.12
            accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
            return sorted(dep.name for dep in accesses.read_writes.writes)
        return sorted(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}))
    finally:
        driver._active = previous


def _summary(error: Exception) -> str:
    """An error's first line and, where it says more, its last (a Triton compile error's first is
    the source position, its last the cause)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def compile_for_rocm() -> int:
    """The --rocm run: the preset's kernels, every dtype, for CDNA3, and torch.compile's copy of
    each kernel (which holds the kernels' ROCm forms)."""
    failures = checked = 0
    kernels = {}
    for dtype in DTYPES:
        for kernel, args, constexprs in kernel_calls(*QUICK_SHAPES[0], dtype, False, torch.int64):
            kernels[kernel] = None
            checked += 1
            try:
                compile_for(kernel, args, constexprs, target=CDNA3)
            except Exception as error:  # report every failing case, not just the first
                failures += 1
                print(f"FAIL {kernel.__name__} {dtype} for {CDNA3.arch}: {_summary(error)}", flush=True)
    failures += inductor_copy_failures(kernels)
    checked += len(kernels)
    print(f"triton {triton.__version__}: {checked - failures} of {checked} kernels compiled for {CDNA3.arch} "
          "and torch.compile's copies, as a ROCm build of torch launches them")
    return 1 if failures else 0


def inductor_copy_failures(kernels) -> int:
    """How many of `kernels` have a torch.compile copy that names what it does not define (each printed)."""
    failures = 0
    for kernel in kernels:
        errors = inductor_copy_errors(kernel)
        if errors:
            failures += 1
            print(f"FAIL torch.compile's copy of {kernel.__name__}: {errors[0]}", flush=True)
    return failures


def inductor_copy_errors(kernel) -> list[str]:
    """The names a function in torch.compile's copy of `kernel` loads and the copy does not define.
    Inductor's generated code holds its common imports, the kernel's source, that of the
    functions it calls, and the imports and constants among their globals that it recognizes; a
    name it misses fails only when a compile reaches that line, e.g. in float64 alone."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    copy = user_defined_triton_kernel_transitive_closure_source_code(kernel)
    source = TritonKernel.gen_common_triton_imports() + copy
    with tempfile.TemporaryDirectory() as folder:  # triton.jit reads a function's source from its file
        path = pathlib.Path(folder) / f"inductor_copy_of_{kernel.__name__}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    defined = vars(module).keys() | vars(builtins).keys()
    errors = []
    for name, function in vars(module).items():
        if isinstance(function, triton.runtime.jit.JITFunction):
            loads = {i.argval for i in dis.Bytecode(function.fn) if i.opname == "LOAD_GLOBAL"}
            errors += [f"{name} loads {missing}, which the copy does not define" for missing in sorted(loads - defined)]
    return errors


def compile_shared_tile_for_hopper() -> None:
    """msda_shared_tile_kernel (a Gluon kernel: its own AST source) for sm_90, with the arguments
    `launch.shared_tile_call` gives at the encoder preset's shape. (Not traced by torch.compile,
    so no written-arguments check.)"""
    from triton.experimental.gluon._runtime import GluonASTSource

    value = torch.zeros(1, 3, 8, 32)
    loc, attn = torch.zeros(1, 3, 8, 4, 4, 2), torch.zeros(1, 3, 8, 4, 4)
    shapes, starts = torch.ones(4, 2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    _, args, constexprs = launch.shared_tile_call(torch.zeros(1, 3, 256), value, shapes, starts, loc, attn, value)
    compiled = compile_for(launch.msda_shared_tile_kernel, args, constexprs, source_type=GluonASTSource)[1]
    errors = shared_tile_allocation_errors(compiled.metadata.shared, constexprs)
    if errors:
        raise AssertionError(errors[0])


def shared_tile_allocation_errors(shared_bytes: int, constexprs: dict) -> list[str]:
    """The shared tile reads and writes its rows through inline PTX at `global_smem` + row *
    ROW_BYTES, which is right only while its one allocation is all the shared memory the compiled
    kernel has: a release that added a buffer of its own (a layout conversion's scratch) could
    place it, or the tile, elsewhere, and the PTX would read the wrong bytes."""
    expected = constexprs["ROWS"] * constexprs["HEAD_DIM"] * 4
    if shared_bytes != expected:
        return [f"the shared tile's kernel has {shared_bytes} bytes of shared memory, its tile {expected}"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--full", action="store_true", help="108 (L, K, D) shapes and int64 indices too")
    modes.add_argument("--preset", action="store_true",
                       help="the preset's shape alone, every dtype, the default flags (CI's second triton)")
    modes.add_argument("--rocm", action="store_true", help="the preset's kernels compiled for gfx942 (CDNA3)")
    args = parser.parse_args()
    if ROCM:
        return compile_for_rocm()
    full, preset = args.full, args.preset
    failures = checked = 0
    if full:
        cases = list(itertools.product(FULL_SHAPES, DTYPES, (False, True), (torch.int64, torch.int32), (False, True)))
    else:
        # Every quick shape with int64 spatial shapes and the default (unfused) softmax. int32
        # spatial shapes (a scalar load's width) and the fused softmax (launch.FUSED_SOFTMAX, off
        # by default; the GPU tier compiles it at the decoder preset) at the preset only, and 64-bit
        # indices there too: its 16 x 1 forward tiles once crashed with them. All of them at
        # every quick shape took 1,124 compiles, ~10 minutes of one core in CI (bench/NOTES.md
        # entry 102); --full still runs every combination.
        cases = list(itertools.product(QUICK_SHAPES, DTYPES, (False,), (torch.int64,), (False,)))
        cases += [c for c in itertools.product(QUICK_SHAPES[:1], DTYPES, (False, True), (torch.int64, torch.int32),
                                               (False, True)) if c not in cases]  # fmt: skip
    timed = list(itertools.product(TIMED_SHAPES, ("float32", "bfloat16"), (False,), (torch.int64,), (False, True)))
    if preset:  # int64 spatial shapes, 32-bit indices, the unfused softmax: what most calls compile
        cases = [c for c in cases if c[0] == QUICK_SHAPES[0] and c[2:] == (False, torch.int64, False)]
        timed = []
    for ((levels, points, head_dim), dtype, index_64, index, softmax), is_timed in [(c, False) for c in cases] + [
        (c, True) for c in timed
    ]:
        # The preset's kernels once more with their integer arguments as constants (see above).
        constant_ints = (levels, points, head_dim) == QUICK_SHAPES[0] and not index_64 and not is_timed
        calls = kernel_calls(levels, points, head_dim, dtype, index_64, index, softmax, fixed_point=not is_timed,
                             fixed_point_lists=constant_ints and index == torch.int64)  # fmt: skip
        for kernel, args, constexprs in calls:
            what = (f"{kernel.__name__} {dtype} L={levels} K={points} D={head_dim} int64={index_64} shapes={index}"
                    f" softmax={softmax}")
            checked += 1
            try:
                seconds = compile_for(kernel, args, constexprs, timed=is_timed)[0]
                if is_timed:
                    print(f"compile time {what}: {seconds:.1f} s", flush=True)
                    if seconds > COMPILE_SECONDS:
                        raise AssertionError(f"compiled in {seconds:.0f} s, over the {COMPILE_SECONDS:.0f} s bound")
                    continue
                written = written_arguments(kernel, args, constexprs)
                if written != outputs(kernel, constexprs, softmax):
                    raise AssertionError(f"torch.compile believes it writes {written}")
                if constant_ints:
                    what += " integer arguments as constants"
                    checked += 1
                    compile_for(kernel, args, constexprs, constant_ints=True)
            except Exception as error:  # report every failing case, not just the first
                failures += 1
                print(f"FAIL {what}: {_summary(error)}", flush=True)
    kernels = {call[0]: None for call in kernel_calls(*QUICK_SHAPES[0], "float32", False, torch.int64)}
    failures += inductor_copy_failures(kernels)
    checked += len(kernels)
    if launch.msda_shared_tile_kernel is not None:  # Gluon: compiled once, at the preset's constants
        checked += 1
        try:
            compile_shared_tile_for_hopper()
        except Exception as error:  # noqa: BLE001
            failures += 1
            print(f"FAIL msda_shared_tile_kernel: {_summary(error)}", flush=True)
    print(f"triton {triton.__version__}: {checked - failures} of {checked} kernels compiled for sm_90, "
          "torch.compile sees them write their outputs alone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
