"""The eager path's launcher (msda/kernels/direct.py) against the installed Triton, without a GPU:
the C launch it calls directly gets what `CompiledKernel[grid]` would have passed, hooks aside;
other launchers take the public route; a set launch hook sends launches to Triton's JIT path."""

from __future__ import annotations

import pytest

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
