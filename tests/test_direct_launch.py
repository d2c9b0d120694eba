"""The eager path's launcher (msda/kernels/direct.py) against the installed Triton, without a GPU:
the C launch it calls directly gets what `CompiledKernel[grid]` would have passed, hooks aside;
other launchers take the public route; a set launch hook sends launches to Triton's JIT path; a
kernel is reused only for integers Triton would have compiled the same code for."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.driver")
from triton import knobs  # noqa: E402
from triton.backends.nvidia.driver import CudaLauncher  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

from msda.kernels import direct  # noqa: E402

GRID, STREAM, ARGS = (7, 1, 1), 1234, (0x7F00_0000_0000, 300, 22223, None)


def _compiled_kernel(recorded: list) -> CompiledKernel:
    """A CompiledKernel as Triton 3's CUDA backend makes one, loaded, whose C launch records its
    arguments instead of launching."""
    launcher = CudaLauncher.__new__(CudaLauncher)
    launcher.launch = lambda *args: recorded.append(args)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    compiled = CompiledKernel.__new__(CompiledKernel)
    compiled.module, compiled.function, compiled._run = object(), 0xF00D, launcher
    compiled.packed_metadata, compiled.name, compiled.src = (4, 1, 0), "msda_forward_kernel", None
    return compiled


def test_the_direct_c_launch_passes_what_the_public_route_does():
    public, direct_route = [], []
    _compiled_kernel(public)[GRID](*ARGS, stream=STREAM)
    launch, head = direct._c_launch(_compiled_kernel(direct_route))
    launch(*GRID, STREAM, *head, *ARGS)
    (got,), (want,) = direct_route, public
    # grid, stream, function, cooperative grid, PDL, the two scratch buffers, kernel metadata
    assert got[:10] == want[:10] == (*GRID, STREAM, 0xF00D, False, True, None, None, (4, 1, 0))
    # launch metadata and the hook chains: made and passed by the public route, none here
    assert got[10:13] == (None, None, None)
    assert want[11] is knobs.runtime.launch_enter_hook and want[12] is knobs.runtime.launch_exit_hook
    assert got[13:] == want[13:] == ARGS


def test_a_launcher_it_was_not_written_for_takes_the_public_route():
    recorded = []
    compiled = _compiled_kernel(recorded)
    compiled._run.global_scratch_size = 64  # scratch memory: CudaLauncher.__call__ allocates it
    compiled._run.global_scratch_align = 16
    launch, head = direct._c_launch(compiled)
    assert head == () and launch is not compiled._run.launch


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
    assert [args[-2] for args in kernel.c_launches] == [32, 33, 1, 48]
