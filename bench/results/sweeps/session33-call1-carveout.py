"""The L1 / shared-memory carveout of msda's kernels (session 33, call 1).

Triton sets no carveout preference for a kernel of 48 KB of shared memory or less
(backends/nvidia/driver.c: only above 48 KB does it ask for shared memory), so the driver picks
the split of each SM's 256 KB between L1 and shared memory. The forwards are bound by their
gathers' latency and their L1 hit rates (13.8% at the float32 decoder, 44% at the float32
encoder `local`, bench/NOTES.md entry 60) depend on the L1's size. Here every compiled msda
kernel gets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = -1 (the default, no
preference), 0 (the most L1) or 100 (the most shared memory), and the cells are timed in turns.
If the default already gives the most L1, 0 moves nothing and 100 shows what a smaller L1 costs.
Profiler us of a call (the backward's fill included), three rounds in turns."""
import ctypes
import sys

import torch

sys.path.insert(0, ".")
from bench.timing import profiler_device_time  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels.backward import msda_backward_kernel  # noqa: E402
from msda.kernels.forward import msda_forward_kernel  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

cuda = ctypes.CDLL("libcuda.so.1")
ATTR_SHARED_SIZE, ATTR_NUM_REGS, ATTR_CARVEOUT = 1, 4, 9


def functions():
    out = []
    for kernel in (msda_forward_kernel, msda_backward_kernel):
        for device_cache in kernel.device_caches.values():
            for compiled in device_cache[0].values():
                compiled.run  # noqa: B018  (loads the module)
                out.append((kernel.fn.__name__, compiled))
    return out


def get(function, attr):
    value = ctypes.c_int()
    rc = cuda.cuFuncGetAttribute(ctypes.byref(value), attr, ctypes.c_void_p(function))
    return value.value if rc == 0 else f"rc {rc}"


def set_carveout(percent):
    for _, compiled in functions():
        rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), ATTR_CARVEOUT, percent)
        assert rc == 0, rc


def cells():
    out = {}
    for preset, dtype, dist in [
        ("decoder", torch.float32, "uniform"), ("decoder", torch.float32, "local"),
        ("encoder", torch.float32, "uniform"), ("encoder", torch.float32, "local"),
        ("decoder", torch.float16, "uniform"), ("encoder", torch.float16, "local"),
    ]:
        inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=3)
        args = inputs.args()
        grad = torch.randn(args[0].shape[0], args[3].shape[1], args[0].shape[2] * args[0].shape[3],
                           device="cuda", dtype=dtype)
        name = f"{preset} {str(dtype)[6:]} {dist}"
        out[name + " fwd"] = lambda a=args: eager.launch_forward(*a)
        out[name + " bwd"] = lambda a=args, g=grad: eager.launch_backward(g, *a)
    return out


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    fns = cells()
    results = {fn: fns[fn]() for fn in fns}  # compile
    torch.cuda.synchronize()
    for name, compiled in functions():
        f = compiled.function
        print(f"{name}: shared {get(f, ATTR_SHARED_SIZE)} B static, metadata {compiled.metadata.shared} B, "
              f"regs {get(f, ATTR_NUM_REGS)}, carveout pref {get(f, ATTR_CARVEOUT)}", flush=True)
    settings = (-1, 0, 100)
    times = {(s, k): [] for s in settings for k in fns}
    for _ in range(3):
        for s in settings:
            set_carveout(s)
            for k, fn in fns.items():
                times[s, k].append(profiler_device_time(fn, calls=20, repeats=2).median_us)
    set_carveout(0)
    for k, fn in fns.items():  # forwards under the largest L1: the same bits (the backward's atomics reorder)
        same = torch.equal(fn(), results[k]) if k.endswith("fwd") else "-"
        row = "  ".join(f"{s:>4}: {min(times[s, k]):7.1f}-{max(times[s, k]):7.1f}" for s in settings)
        print(f"{k:<28} {row}  (us; same bits at 0: {same})", flush=True)


def ncu_probe():
    """Under ncu: the float32 encoder `local` forward at each setting, one launch each."""
    fns = cells()
    fn = fns["encoder float32 local fwd"]
    fn()
    torch.cuda.synchronize()
    for s in (-1, 0, 100):
        set_carveout(s)
        fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    ncu_probe() if "--ncu" in sys.argv else main()
