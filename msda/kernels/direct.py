"""Launch a compiled Triton kernel without the JIT's per-call work.

`kernel[grid](*args)` binds every argument, computes its specialization key and looks the key up
on each call: tens of microseconds of Python for a kernel that runs for ten at the decoder preset.
The eager fast path (msda/eager.py) knows the key already (the launch settings, the dtypes, the
integers' classes and the device), so it keeps each compiled kernel under that key and calls
Triton's C launcher for it directly. `CompiledKernel[grid](..., stream=...)`, the public route,
adds per launch a closure, the launch metadata for the launch hooks (a dict, made even while no
hook is set: the hooks are chains, never None), calls of both hook chains and the scratch
allocators (bench/NOTES.md entry 64). Triton 3.7 replaced 3.6's C function with one that takes
the kernel's arguments as a tuple beside their annotations (bench/NOTES.md entry 104); both
forms are here. Where the compiled kernel's launcher is not one this was written for (a kernel
with scratch memory, a Triton release not in C_LAUNCH_TRITON), launches take the public route.

The key holds all that Triton specializes a compiled kernel on: the device, the constexprs and
launch options, each tensor's dtype (its pointer 16-byte aligned: PyTorch allocations are), and
each integer as Triton classes it: 1 (compiled in as a constant), a multiple of 16 (compiled
with that divisibility assumed), or another. The class matters where an integer argument is not
`do_not_specialize` (the shared tile's are not): a kernel compiled at num_queries = 1 and
launched at 5,440 would take every program for a query block of one query. A call outside that
(a misaligned view, an integer past 2**31, a launch hook such as a profiler's) takes the JIT
path instead, which is always correct. So does everything on the first call of a key, which
compiles.

The compiled kernel gets each tensor as its data pointer, an int: given a tensor, Triton's
launcher calls its data_ptr() and asks the CUDA driver whether the address is a device one
(cuPointerGetAttribute), for each of the backward's 15 tensors (bench/NOTES.md entry 42). The
callers pass CUDA tensors of the launch's device (msda/eager.py checks), which is what that asks.

Building that key and the pointers costs about as much again as the launch itself (a launch of
the forward 5.3 us on a CPU whose empty tensor op takes 3.4). `prepare` keeps what a launch
resolved, for a caller that knows a later launch will have the same grid, integers, tensor dtypes
and constexprs (msda/eager.py keys them by the call's shapes, dtypes and flags): a `Prepared`
launch takes the tensors alone.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from triton import knobs

from .launch import TRITON_RELEASE


class DirectLauncher:
    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (launch function, its fixed arguments after the stream, constexpr values in signature order)
        self.compiled: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int], args: tuple, constexprs: dict, device: torch.device) -> None:
        """Launch on `device`'s current stream. `args` are the kernel's positional arguments,
        `constexprs` its constexpr arguments and launch options."""
        key = _key(args, constexprs, device)
        entry = self.compiled.get(key)
        if entry is not None and not _hooked():
            plain = _plain(args)
            if plain is not None:
                launch, kernel_args, tail = entry
                grid = (*grid, 1, 1)
                launch(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device.index), *kernel_args,
                       *plain, *tail)  # fmt: skip
                return
        compiled = self.kernel[grid](*args, **constexprs)
        if entry is None and compiled is not None and _plain(args) is not None:
            names = self.kernel.arg_names[len(args) :]
            self.compiled[key] = (*_c_launch(compiled), tuple(constexprs[name] for name in names))

    def prepare(self, grid: tuple[int], args: tuple, constexprs: dict, device: torch.device) -> Prepared | None:
        """After a launch with these arguments: a launch of the same compiled kernel with the same
        grid and integers, for tensors of the same dtypes in the same places (None where this
        launch did not go through the C function, e.g. a misaligned pointer)."""
        entry = self.compiled.get(_key(args, constexprs, device))
        if entry is None or _plain(args) is None:
            return None
        launch, kernel_args, tail = entry
        slots = tuple(a if type(a) is int else None for a in args)
        return Prepared((*grid, 1, 1)[:3], launch, kernel_args, slots, tail, device.index)


class Prepared(NamedTuple):
    """A launch `DirectLauncher.prepare` resolved: call it with the tensors of the arguments, in
    order (their pointers go to the None slots). It returns False and launches nothing where a
    pointer is not 16-byte aligned or a launch hook is set: the caller then launches through
    `DirectLauncher`."""

    grid: tuple[int, int, int]
    launch: Callable
    kernel_args: tuple  # the C function's arguments after the stream
    slots: tuple  # each positional argument: its integer, or None for a tensor
    tail: tuple  # the constexpr arguments' values, in signature order
    device_index: int

    def __call__(self, tensors: tuple) -> bool:
        if _hooked():
            return False
        tensors = iter(tensors)
        plain = []
        for slot in self.slots:
            if slot is None:
                slot = next(tensors).data_ptr()
                if slot % 16:
                    return False
            plain.append(slot)
        x, y, z = self.grid
        self.launch(x, y, z, torch._C._cuda_getCurrentRawStream(self.device_index), *self.kernel_args, *plain,
                    *self.tail)  # fmt: skip
        return True


def _key(args: tuple, constexprs: dict, device: torch.device) -> tuple:
    """A launch's compiled kernel: the device, each tensor's dtype, each int's class as in
    triton.runtime.jit ("1", True for a multiple of 16, else False), the constexprs."""
    return (
        device.index, *(("1" if a == 1 else a % 16 == 0) if type(a) is int else a.dtype for a in args),
        *constexprs.values(),
    )  # fmt: skip


# The triton releases whose CUDA launcher's C function `_c_launch` calls, each with how that
# function takes the kernel's arguments: 3.6's spread after its fixed arguments, 3.7's generic
# launcher (3.8 keeps it) as one tuple after their annotations and the signature
# (tests/test_direct_launch.py compares each with what the public route passes).
C_LAUNCH_TRITON = {"3.6": "spread", "3.7": "tuple", "3.8": "tuple"}


def _c_launch(compiled) -> tuple:
    """(launch, arguments): `launch(gridX, gridY, gridZ, stream, *arguments, *kernel_arguments)`
    runs `compiled` without a launch hook. Triton's CUDA launcher (triton/backends/nvidia/
    driver.py) of a release in C_LAUNCH_TRITON where the kernel needs no scratch memory; else
    `compiled[grid]`, the public route."""
    launcher = compiled.run  # loads the kernel and builds the launcher, once
    form = C_LAUNCH_TRITON.get(TRITON_RELEASE)
    if (
        form is not None
        and type(launcher).__name__ == "CudaLauncher"
        and getattr(launcher, "global_scratch_size", None) == 0
        and getattr(launcher, "profile_scratch_size", None) == 0
        and not getattr(launcher, "gsan_enabled", False)  # 3.8's sanitizer appends an argument
        and hasattr(launcher, "launch_pdl")
        and hasattr(compiled, "packed_metadata")
    ):
        c_function, function = launcher.launch, compiled.function
        cooperative, pdl, metadata = launcher.launch_cooperative_grid, launcher.launch_pdl, compiled.packed_metadata
        if form == "spread":
            # After the stream: the function, cooperative grid, PDL, global and profile scratch,
            # the kernel's metadata, the launch metadata, enter and exit hooks.
            return c_function, (function, cooperative, pdl, None, None, metadata, None, None, None)
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature

        def launch(grid_x, grid_y, grid_z, stream, *kernel_args):
            # After the stream: the function, cooperative grid, PDL, the kernel's metadata, the
            # launch metadata, enter and exit hooks, global and profile scratch, then the
            # arguments' annotations (which of them are constexprs), the signature, the arguments.
            c_function(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, metadata, None, None, None, None,
                       None, annotations, signature, kernel_args)  # fmt: skip

        return launch, ()

    def launch(grid_x, grid_y, grid_z, stream, *kernel_args):
        compiled[(grid_x, grid_y, grid_z)](*kernel_args, stream=stream)

    return launch, ()


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's, such as proton's): the JIT path calls it.
    Triton's hooks are chains (knobs.HookChain), set when they hold a call."""
    return any(
        hook is not None and getattr(hook, "calls", True) != []
        for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    )


def _plain(args: tuple) -> list[int] | None:
    """The arguments as the cached kernel takes them, tensors as their data pointers, if it was
    compiled for them (16-byte-aligned pointers, 32-bit integers); else None."""
    plain = []
    for a in args:
        if type(a) is int:
            if not -(2**31) <= a < 2**31:
                return None
            plain.append(a)
        else:
            pointer = a.data_ptr()
            if pointer % 16:
                return None
            plain.append(pointer)
    return plain
