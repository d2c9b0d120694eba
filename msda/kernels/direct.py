"""Launch a compiled Triton kernel without the JIT's per-call work.

`kernel[grid](*args)` binds every argument, computes its specialization key and looks the key up
on each call: tens of microseconds of Python for a kernel that runs for ten at the decoder preset.
The eager fast path (msda/eager.py) knows the key already (the launch settings, the dtypes and
the device), so it keeps each compiled kernel under that key and launches it through
`CompiledKernel[grid](..., stream=...)`.

The key holds all that the compiled code depends on because the kernels specialize on nothing
else: their integer arguments are `do_not_specialize` (so 32-bit while below 2**31), and their
pointers are 16-byte aligned (PyTorch allocations are). A call outside that (a misaligned view, a
size past 2**31, a launch hook such as a profiler's) takes the JIT path instead, which is always
correct. So does everything on the first call of a key, which compiles.

The compiled kernel gets each tensor as its data pointer, an int: given a tensor, Triton's
launcher calls its data_ptr() and asks the CUDA driver whether the address is a device one
(cuPointerGetAttribute), for each of the backward's 15 tensors (bench/NOTES.md entry 42). The
callers pass CUDA tensors of the launch's device (msda/eager.py checks), which is what that asks.
"""

from __future__ import annotations

import torch
from triton import knobs


class DirectLauncher:
    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}  # key -> (CompiledKernel, constexpr values in signature order)

    def __call__(self, grid: tuple[int], args: tuple, constexprs: dict, device: torch.device) -> None:
        """Launch on `device`'s current stream. `args` are the kernel's positional arguments,
        `constexprs` its constexpr arguments and launch options."""
        key = (device.index, *(type(a) is int or a.dtype for a in args), *constexprs.values())
        entry = self.compiled.get(key)
        if entry is not None and not _hooked():
            plain = _plain(args)
            if plain is not None:
                compiled, tail = entry
                grid = (*grid, 1, 1)[:3]
                compiled[grid](*plain, *tail, stream=torch._C._cuda_getCurrentRawStream(device.index))
                return
        compiled = self.kernel[grid](*args, **constexprs)
        if entry is None and compiled is not None and _plain(args) is not None:
            names = self.kernel.arg_names[len(args) :]
            self.compiled[key] = (compiled, tuple(constexprs[name] for name in names))


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's, such as proton's): the JIT path calls it."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and getattr(hook, "calls", True) != []


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
