"""The eager backward with and without its prepared launch, in one process (session 34, call 2).

As session 33's call 5 did for the forward: at the decoder preset (float32, bfloat16), forward +
torch.autograd.grad through `msda.multi_scale_deformable_attention`, and `eager.launch_backward`
alone, with the backward's prepared launch (the default) and without it (`DirectLauncher.prepare`
made to give None, so every backward builds its arguments and the launcher's key, as before
this change, plus the key and tensors of the prepared path, which it then cannot take: timed
apart below), in turns: 9 rounds of 100 calls, one synchronize a round, us a call."""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.kernels import launch  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    prepare = eager._backward_kernel.prepare
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", seed=3)
        value, shapes, starts, loc, attn = inputs.args()
        leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
        grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda", dtype=dtype)
        f = msda.multi_scale_deformable_attention

        def step():
            v, l, a = leaves
            torch.autograd.grad(f(v, shapes, starts, l, a), leaves, grad)

        def backward_alone():
            eager.launch_backward(grad, value, shapes, starts, loc, attn)

        for name, fn in (("forward + backward", step), ("launch_backward", backward_alone)):
            times = {"prepared": [], "not prepared": []}
            for _ in range(9):
                for variant in times:
                    eager._backward_launches.clear()
                    eager._backward_kernel.prepare = prepare if variant == "prepared" else (lambda *a: None)
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(100):
                        fn()
                    torch.cuda.synchronize()
                    times[variant].append((time.perf_counter() - t) / 100 * 1e6)
            eager._backward_kernel.prepare = prepare
            row = "  ".join(f"{k} {statistics.median(v):6.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in times.items())
            print(f"{str(dtype)[6:]:<9} {name:<20} {row}", flush=True)
        # What the "not prepared" side does beyond the code before: the key and the tensors.
        grad_value = torch.zeros_like(value, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        grad_loc, grad_attn = torch.empty_like(loc), torch.empty_like(attn)
        t = time.perf_counter()
        for _ in range(10000):
            launch.backward_signature(grad, value, shapes, starts, loc, attn, grad_value)
            launch.backward_tensors(grad, value, shapes, starts, loc, attn, grad_value, grad_loc, grad_attn)
        print(f"{str(dtype)[6:]:<9} signature + tensors  {(time.perf_counter() - t) / 10000 * 1e6:.2f} us", flush=True)


if __name__ == "__main__":
    main()
