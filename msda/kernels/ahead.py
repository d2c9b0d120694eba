"""Compile a kernel in a background thread before its first launch.

A kernel's first launch in a process compiles it (Triton's front end, its MLIR passes, ptxas)
and builds its C launcher (the host's C compiler): over a second on an H200 host for the shared
tile's Gluon kernel (bench/NOTES.md entry 51), which only the float32 encoder's backward
launches. A forward that knows its backward will launch it starts that work here, and the
backward waits for it before the launch: the work overlaps the forward's own compiles (the
passes, ptxas and the C compiler release the GIL) and whatever runs until the backward.

The thread is not a daemon: a process that ends while it compiles waits for it (at most the
compile's time). A daemon thread still inside Triton's compile when the interpreter shut down
aborted the process on an H200 host (SIGABRT: the exit's cleanup removed the temporary directory
the C compiler was writing the launcher into, then the thread's unwinding aborted; bench/NOTES.md
entry 69).

The thread makes no CUDA call that could disturb a stream or a graph being captured: it compiles
(Triton's JIT cache keeps the kernel under the key a launch with these arguments computes) and
builds the launcher (Triton's on-disk cache keeps it); loading the module onto the GPU is left to
the first launch. If anything fails here, the launch compiles again and raises what there is.
"""

from __future__ import annotations

import threading

import torch
from triton.runtime import driver
from triton.runtime.jit import MockTensor

_lock = threading.Lock()
_started: set[tuple] = set()  # the calls' keys, once a process
_pending: dict[object, list[threading.Thread]] = {}  # kernel -> threads not yet waited for


def start(kernel, args: tuple, constexprs: dict, device: torch.device) -> None:
    """Compile `kernel` for a launch with these arguments (tensors or their dtypes, ints), once
    a process for each (device, dtypes, ints, constexprs)."""
    mock = tuple(a if type(a) is int else MockTensor(a if isinstance(a, torch.dtype) else a.dtype) for a in args)
    key = (kernel, device.index, *(a if type(a) is int else a.dtype for a in mock), *constexprs.items())
    with _lock:
        if key in _started:
            return
        _started.add(key)
        thread = threading.Thread(
            target=_compile, args=(kernel, mock, constexprs, device), name="msda-compile-ahead", daemon=False
        )
        _pending.setdefault(kernel, []).append(thread)
    thread.start()


def wait(kernel) -> None:
    """Wait for the compiles `start` began for `kernel` (before its launch: a launch while one
    runs would compile the kernel a second time)."""
    if not _pending:  # (every backward asks: most never started one)
        return
    with _lock:
        threads = _pending.pop(kernel, [])
    for thread in threads:
        thread.join()


def _compile(kernel, args: tuple, constexprs: dict, device: torch.device) -> None:
    try:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=(1,), **constexprs)
            driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001  (the launch compiles again and raises it)
        pass
