"""The eager forward with and without its prepared launch, in one process (session 33, call 5).

Call 4's `python -m bench.calls` runs could not compare the two trees (the working directory's
msda came first on both paths), and the same code's rows moved 30% from run to run there. Here
one process times `msda.multi_scale_deformable_attention` without grad at the decoder preset
(float32, and bfloat16), and forward + torch.autograd.grad, with the prepared launch (the
default) and without it (`DirectLauncher.prepare` made to give None, so every call builds its
arguments and the launcher's key, as before d1cd794), in turns: 9 rounds of 300 calls (100 for
the steps), one synchronize a round, us a call."""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    prepare = eager._forward_kernel.prepare
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", seed=3)
        value, shapes, starts, loc, attn = inputs.args()
        leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
        grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda", dtype=dtype)
        f = msda.multi_scale_deformable_attention

        def no_grad():
            with torch.no_grad():
                f(value, shapes, starts, loc, attn)

        def step():
            v, l, a = leaves
            torch.autograd.grad(f(v, shapes, starts, l, a), leaves, grad)

        for name, fn, calls in (("forward, no grad", no_grad, 300), ("forward + backward", step, 100)):
            times = {"prepared": [], "not prepared": []}
            for _ in range(9):
                for variant in times:
                    eager._forward_launches.clear()
                    eager._forward_kernel.prepare = prepare if variant == "prepared" else (lambda *a: None)
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    torch.cuda.synchronize()
                    times[variant].append((time.perf_counter() - t) / calls * 1e6)
            eager._forward_kernel.prepare = prepare
            row = "  ".join(f"{k} {statistics.median(v):6.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in times.items())
            print(f"{str(dtype)[6:]:<9} {name:<20} {row}", flush=True)


if __name__ == "__main__":
    main()
