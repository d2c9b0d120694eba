"""The eager path's launcher (msda/kernels/direct.py) against the installed Triton, without a GPU:
the C launch it calls directly gets what `CompiledKernel[grid]` would have passed, hooks aside;
other launchers take the public route; a set launch hook sends launches to Triton's JIT path; a
kernel is reused only for integers Triton would have compiled the same code for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

pytest.importorskip("triton.backends.nvidia.driver")
from triton import knobs  # noqa: E402
from triton.backends.nvidia.driver import CudaLauncher  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

from msda.kernels import direct  # noqa: E402

GRID, STREAM, ARGS = (7, 1, 1), 1234, (0x7F00_0000_0000, 300, 22223, None)


class _LoadedKernel(CompiledKernel):
    def __del__(self):  # nothing to unload (triton 3.8's would ask the CUDA driver to)
        pass


# How the installed release's C function takes the kernel's arguments (the fakes' launcher is its).
FORM = direct.C_LAUNCH_TRITON.get(direct.TRITON_RELEASE, "spread")
ANNOTATIONS, SIGNATURE = object(), b"signature"  # 3.7's: which arguments are constexprs; their C types


def _compiled_kernel(recorded: list) -> CompiledKernel:
    """A CompiledKernel as Triton 3's CUDA backend makes one, loaded, whose C launch records its
    arguments instead of launching (with the attributes of 3.6's launcher and of 3.7's)."""
    launcher = CudaLauncher.__new__(CudaLauncher)
    launcher.launch = lambda *args: recorded.append(args)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.arg_annotations, launcher.kernel_signature, launcher.gsan_enabled = ANNOTATIONS, SIGNATURE, False
    compiled = _LoadedKernel.__new__(_LoadedKernel)
    compiled.module, compiled.function, compiled._run = object(), 0xF00D, launcher
    compiled.packed_metadata, compiled.name, compiled.src = (4, 1, 0), "msda_forward_kernel", None
    return compiled


def _kernel_args(c_launch: tuple) -> tuple:
    """The kernel's arguments in a recorded C launch: after 13 others (3.6), or its last (3.7)."""
    return c_launch[-1] if FORM == "tuple" else c_launch[13:]


def test_the_direct_c_launch_passes_what_the_public_route_does(monkeypatch):
    """On the triton releases it was written for (C_LAUNCH_TRITON); any other takes the public
    route (the next tests)."""
    # 3.8's launcher reads the active driver (for profile scratch, none here): none without a GPU
    monkeypatch.setattr(triton.runtime.driver, "_active", object())
    public, direct_route = [], []
    launch, head = direct._c_launch(_compiled_kernel(direct_route))
    if direct.TRITON_RELEASE not in direct.C_LAUNCH_TRITON:
        assert head == () and launch.__name__ == "launch" and launch.__module__ == direct.__name__
        return
    _compiled_kernel(public)[GRID](*ARGS, stream=STREAM)
    launch(*GRID, STREAM, *head, *ARGS)
    (got,), (want,) = direct_route, public
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if FORM == "spread":
        # grid, stream, function, cooperative grid, PDL, the two scratch buffers, kernel metadata
        assert got[:10] == want[:10] == (*GRID, STREAM, 0xF00D, False, True, None, None, (4, 1, 0))
        # launch metadata and the hook chains: made and passed by the public route, none here
        assert got[10:13] == (None, None, None) and want[11] is enter and want[12] is exit_
        assert got[13:] == want[13:] == ARGS
    else:
        # grid, stream, function, cooperative grid, PDL, kernel metadata
        assert got[:8] == want[:8] == (*GRID, STREAM, 0xF00D, False, True, (4, 1, 0))
        assert got[8:11] == (None, None, None) and want[9] is enter and want[10] is exit_
        # the two scratch buffers, the annotations, the signature, the arguments as one tuple
        assert got[11:] == want[11:] == (None, None, ANNOTATIONS, SIGNATURE, ARGS)
    assert len(got) == len(want)


def test_a_launcher_it_was_not_written_for_takes_the_public_route():
    recorded = []
    compiled = _compiled_kernel(recorded)
    compiled._run.global_scratch_size = 64  # scratch memory: CudaLauncher.__call__ allocates it
    compiled._run.global_scratch_align = 16
    launch, head = direct._c_launch(compiled)
    assert head == () and launch is not compiled._run.launch


def test_another_triton_release_takes_the_public_route(monkeypatch):
    """A release whose launcher `_c_launch` was not checked against launches through
    `compiled[grid]`, which passes the launcher the grid, the stream and the arguments."""
    monkeypatch.setattr(direct, "C_LAUNCH_TRITON", {})
    recorded = []
    monkeypatch.setattr(CudaLauncher, "__call__", lambda self, *args: recorded.append(args))
    compiled = _compiled_kernel([])
    launch, head = direct._c_launch(compiled)
    assert head == () and launch is not compiled._run.launch
    launch(*GRID, STREAM, *ARGS)
    ((*got,),) = recorded
    # grid, stream, function, kernel metadata, launch metadata, the hook chains, the arguments
    assert got[:6] == [*GRID, STREAM, 0xF00D, (4, 1, 0)]
    assert got[7] is knobs.runtime.launch_enter_hook and got[8] is knobs.runtime.launch_exit_hook
    assert tuple(got[9:]) == ARGS


def test_a_set_launch_hook_sends_launches_to_the_jit():
    def hook(metadata):
        pass

    assert not direct._hooked()
    for chain in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        chain.add(hook)
        try:
            assert direct._hooked()
        finally:
            chain.remove(hook)
    assert not direct._hooked()


class _JITKernel:
    """A Triton JIT kernel's launch interface, `kernel[grid](*args, **constexprs)`, that records
    its launches and returns a compiled kernel whose C launch records its own."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self):
        self.jit_launches, self.c_launches = [], []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.jit_launches.append(args)
            return _compiled_kernel(self.c_launches)

        return launch


def test_a_kernel_is_reused_only_for_integers_of_its_specialization(monkeypatch):
    """Triton compiles an integer argument that is 1 as a constant and one that is a multiple of
    16 with that divisibility assumed (unless the kernel says do_not_specialize): a launch with
    an integer of another class must not reuse the kernel compiled for the first."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    # The classes as this Triton makes them: 1 a constant, 16 and 32 alike, 17 and 33 alike.
    assert native_specialize_impl(BaseBackend, 1, False, True, True)[0] == "constexpr"
    assert native_specialize_impl(BaseBackend, 16, False, True, True) == ("i32", "D")
    assert native_specialize_impl(BaseBackend, 17, False, True, True) == ("i32", "")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: STREAM, raising=False)
    monkeypatch.setattr(direct, "C_LAUNCH_TRITON", {direct.TRITON_RELEASE: FORM})
    kernel = _JITKernel()
    launcher = direct.DirectLauncher(kernel)
    x = torch.zeros(64)
    assert x.data_ptr() % 16 == 0
    jit_after = []
    for n in (16, 32, 17, 33, 1, 1, 48):
        launcher((2,), (x, n), {"BLOCK": 4}, torch.device("cuda", 0))
        jit_after.append(len(kernel.jit_launches))
    assert jit_after == [1, 1, 2, 2, 3, 3, 3]
    # The reused launches went through the C launch, with their own n.
    assert [_kernel_args(args)[-2] for args in kernel.c_launches] == [32, 33, 1, 48]


def test_a_prepared_launch_passes_what_the_launcher_would(monkeypatch):
    """`DirectLauncher.prepare` after a launch: the same C launch for new tensors of the call's
    dtypes (their pointers in the tensors' places, the integers kept), and nothing launched
    (False) for a misaligned pointer or while a launch hook is set."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: STREAM, raising=False)
    monkeypatch.setattr(direct, "C_LAUNCH_TRITON", {direct.TRITON_RELEASE: FORM})
    kernel = _JITKernel()
    launcher = direct.DirectLauncher(kernel)
    device = torch.device("cuda", 0)
    x, y = torch.zeros(64), torch.ones(64)
    assert direct.DirectLauncher(kernel).prepare((2,), (x, 48), {"BLOCK": 4}, device) is None  # not launched yet
    launcher((2,), (x, 48), {"BLOCK": 4}, device)
    launcher((2,), (x, 48), {"BLOCK": 4}, device)  # the C route
    prepared = launcher.prepare((2,), (x, 48), {"BLOCK": 4}, device)
    assert prepared.slots == (None, 48)
    assert prepared((y,)) is True
    by_launcher, by_prepared = kernel.c_launches[-2:]
    assert by_prepared[:4] == by_launcher[:4] == (2, 1, 1, STREAM)
    fixed = len(by_launcher) - (1 if FORM == "tuple" else 3)
    assert by_prepared[4:fixed] == by_launcher[4:fixed]  # function, launch settings, metadata
    assert _kernel_args(by_launcher)[-3:] == (x.data_ptr(), 48, 4)
    assert _kernel_args(by_prepared)[-3:] == (y.data_ptr(), 48, 4)

    launches = len(kernel.c_launches)
    misaligned = torch.zeros(65)[1:]
    assert misaligned.data_ptr() % 16 and prepared((misaligned,)) is False

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert prepared((y,)) is False
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.c_launches) == launches and len(kernel.jit_launches) == 1


def _forward_variants():
    """Calls of the forward that differ in one thing forward_call reads, or in nothing it reads
    (the data, other tensors of the same metadata)."""
    from msda.testing import Shape, make_inputs

    base = Shape(batch=2, queries=5, heads=2, head_dim=8, levels=((3, 4), (2, 2)), points=2)
    encoder = Shape(batch=1, queries=16, heads=2, head_dim=8, levels=((3, 4), (2, 2)), points=2)  # Q == S
    odd_width = Shape(batch=2, queries=5, heads=2, head_dim=6, levels=((3, 4), (2, 2)), points=3)
    # one size apart from base: the value's width, its pixels, the queries, the points, the levels
    others = [dataclasses.replace(base, head_dim=16), dataclasses.replace(base, levels=((4, 4), (2, 2))),
              dataclasses.replace(base, queries=7), dataclasses.replace(base, points=3),
              dataclasses.replace(base, levels=((3, 4), (1, 2), (1, 1)))]
    variants = []
    for shape in (base, encoder, odd_width, *others):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for seed in (0, 1):
                value, shapes, starts, loc, attn = make_inputs(shape, dtype, seed=seed).args()
                variants.append((value, shapes, starts, loc, attn, False))
                variants.append((value, shapes, None, loc, attn, False))
                variants.append((value, shapes, starts, loc, attn, True))
                variants.append((value, shapes.int(), starts.int(), loc, attn, False))
                variants.append((value, shapes.int(), starts, loc, attn, False))
                variants.append((value, shapes, starts, loc.float(), attn, False))
                variants.append((value, shapes, starts, loc, attn.float(), False))
                variants.append((value, shapes, starts, loc.float(), attn.float(), False))
                # bfloat16 pairs need an even storage offset: a value one element into its storage
                shifted = torch.empty(value.numel() + 1, dtype=dtype)[1:].view(value.shape).copy_(value)
                variants.append((shifted, shapes, starts, loc, attn, False))
    return variants


def _two_rules(rule):
    """`rule` and another launch rule, which gives every call 2-query programs: a key must tell
    a launch made under one from a launch made under the other (the tests replace the rules)."""

    def other_rule(*args, **kwargs):
        return rule(*args, **kwargs)._replace(block_q=2)

    return rule, other_rule


def test_forward_signature_covers_what_forward_call_reads(monkeypatch):
    """Calls with equal `launch.forward_signature` get the same grid, integers, tensor dtypes and
    constexprs from `launch.forward_call` (so one prepared launch serves them all), on the
    Hopper rule and the default one, under two launch rules; and the variants are not all one
    key."""
    from msda.kernels import launch

    for hopper in (False, True):
        monkeypatch.setattr(launch, "register_target", lambda device, hopper=hopper: hopper)
        launches = {}
        for rule in _two_rules(launch.forward_config):
            monkeypatch.setattr(launch, "forward_config", rule)
            for value, shapes, starts, loc, attn, softmax in _forward_variants():
                B, _, M, D = value.shape
                out = value.new_empty((B, loc.shape[1], M * D))
                grid, args, constexprs = launch.forward_call(value, shapes, starts, loc, attn, out, softmax=softmax)
                resolved = (grid, tuple(a if type(a) is int else a.dtype for a in args), constexprs)
                key = launch.forward_signature(value, shapes, starts, loc, attn, softmax)
                assert launches.setdefault(key, resolved) == resolved, key
        assert len(launches) > 50, len(launches)
        pairs = {key: resolved[2]["BF16_PAIRS"] for key, resolved in launches.items()}
        assert True in pairs.values() and False in pairs.values()


def _backward_variants():
    """Plain backward calls (grad_value zeros, with the replicas `grad_value_buffer` gives) that
    differ in one thing backward_call reads, or in nothing it reads: the forward's variants, with
    grad_outputs of other strides (channels contiguous) and of another dtype, accumulators of
    another dtype, and replicas of other rows or none."""
    from msda.kernels.backward import grad_value_buffer

    from msda.testing import Shape, make_inputs

    # Sparse float16 calls: their accumulator is float16, with replicas (the forward's variants
    # are dense: a small float16 grad_value sums them in float32, a bfloat16 one on the CPU too).
    sparse = [
        (*make_inputs(Shape(batch=2, queries=queries, heads=2, head_dim=8, levels=levels, points=1),
                      torch.float16, seed=0).args(), False)
        for queries in (1, 2) for levels in (((3, 4), (2, 2)), ((4, 4), (2, 2)))
    ]  # fmt: skip
    variants = []
    for value, shapes, starts, loc, attn, softmax in _forward_variants() + sparse:
        if softmax:
            continue
        B, Q, M, D = value.shape[0], loc.shape[1], value.shape[2], value.shape[3]
        grad = torch.randn(B, Q, M * D, dtype=value.dtype)
        grads = [grad, grad.transpose(0, 1).contiguous().transpose(0, 1), grad[:1].expand(B, Q, M * D)]
        grads.append(grad.float() if value.dtype != torch.float32 else grad.double())
        for grad_output in grads:
            grad_value, scale, replicas, counts = grad_value_buffer(
                value, grad_output, attn, Q, loc.shape[3], loc.shape[4]
            )
            assert scale is None
            call = (grad_output, value, shapes, starts, loc, attn)
            variants.append((*call, grad_value, replicas, counts))
            if value.element_size() == 2:  # the other accumulator: value's dtype, or float32
                other = grad_value.float() if grad_value.dtype == value.dtype else grad_value.to(value.dtype)
                variants.append((*call, other, None, None))
            if replicas is not None:  # none, one row more, and folded by the fold kernel or by this one
                variants.append((*call, grad_value, None, None))
                more = replicas.new_zeros((B, replicas.shape[1] + 1, M, D))
                variants.append((*call, grad_value, more, counts))
                flipped = None if counts is not None else torch.zeros(B, M, dtype=torch.int32)
                variants.append((*call, grad_value, replicas, flipped))
    return variants


def test_backward_signature_covers_what_backward_call_reads(monkeypatch):
    """Plain backward calls with equal `launch.backward_signature` get the same grid, integers,
    tensor dtypes and constexprs from `launch.backward_call`, on the Hopper rule and the default
    one, and its tensor arguments are `launch.backward_tensors`' (what a prepared launch is given)."""
    from msda.kernels import launch

    variants = _backward_variants()
    for hopper in (False, True):
        monkeypatch.setattr(launch, "register_target", lambda device, hopper=hopper: hopper)
        launches = {}
        for rule in _two_rules(launch.backward_config):
            monkeypatch.setattr(launch, "backward_config", rule)
            for *call, grad_value, replicas, counts in variants:
                grad_loc, grad_attn = torch.empty_like(call[4]), torch.empty_like(call[5])
                grid, args, constexprs = launch.backward_call(
                    *call, grad_value, grad_loc, grad_attn, replicas=replicas, fold_counts=counts
                )
                tensors = launch.backward_tensors(
                    *call, grad_value, grad_loc, grad_attn, replicas=replicas, fold_counts=counts
                )
                assert all(a is b for a, b in zip([a for a in args if type(a) is not int], tensors, strict=True))
                resolved = (grid, tuple(a if type(a) is int else a.dtype for a in args), constexprs)
                key = launch.backward_signature(*call, grad_value, replicas, counts)
                assert launches.setdefault(key, resolved) == resolved, key
        assert len(launches) > 100, len(launches)
        assert {resolved[2]["REPLICAS"] for resolved in launches.values()} == {False, True}
        assert {resolved[2]["FOLD_PIXELS"] > 0 for resolved in launches.values()} == {False, True}
        evicted = {resolved[2]["VALUE_EVICTION"] for resolved in launches.values()}
        assert evicted == ({"", "evict_first"} if hopper else {""})


def test_fold_signature_covers_what_fold_call_reads(monkeypatch):
    """Folds with equal `launch.fold_signature` get the same grid, integers, tensor dtypes and
    constexprs from `launch.fold_call`, whose tensor arguments are `launch.fold_tensors`'; the
    fold's settings (bench.tune and the sweeps change them) are part of the key."""
    from msda.kernels import launch

    launches = {}
    for setting, values in (("FOLD_REPLICAS_A_PROGRAM", (16, 4)), ("FOLD_UNROLL", (4, 1))):
        for setting_value in values:
            monkeypatch.setattr(launch, setting, setting_value)
            for grad_output, value, shapes, starts, loc, attn, grad_value, replicas, _ in _backward_variants():
                if replicas is None:
                    continue
                Q, K = loc.shape[1], loc.shape[4]
                grid, args, constexprs = launch.fold_call(grad_value, replicas, shapes, starts, Q, K)
                tensors = launch.fold_tensors(grad_value, replicas, shapes, starts)
                assert all(a is b for a, b in zip([a for a in args if type(a) is not int], tensors, strict=True))
                resolved = (grid, tuple(a if type(a) is int else a.dtype for a in args), constexprs)
                key = launch.fold_signature(grad_value, replicas, shapes, starts, Q, K)
                assert launches.setdefault(key, resolved) == resolved, key
    assert len(launches) > 20, len(launches)
