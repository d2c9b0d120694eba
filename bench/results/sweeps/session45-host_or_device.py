"""Session 45: is an eager forward + backward's end-to-end time host-bound, or does something in
the step wait for the device? bench.calls' decoder step came to 215 us on an H100 host, about the
do-nothing Function's 95.5 + the device's 97 + the forward's 22, which fits both readings.

For each shape: (a) end to end, 100 steps, one synchronize; (b) the host's enqueue time of 20
steps queued behind a ~50 ms torch.cuda._sleep (a step that waits for the device waits for the
sleep too: its enqueue time jumps by ~50 ms); (c) one step under
torch.cuda.set_sync_debug_mode("warn"), which names any synchronizing call."""

import time
import warnings

import torch

import msda
from msda.testing import PRESETS, Shape, make_inputs

TINY = Shape(batch=1, queries=16, heads=8, head_dim=32, levels=((8, 8), (4, 4)), points=4)


def step_of(shape, dtype=torch.float32):
    value, shapes, starts, loc, attn = make_inputs(shape, dtype, "cuda", seed=3).args()
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda", dtype=dtype)

    def step():
        v, l, a = leaves
        return torch.autograd.grad(msda.multi_scale_deformable_attention(v, shapes, starts, l, a), leaves, grad)

    def noop():
        v, l, a = leaves
        return torch.autograd.grad((v.sum() + l.sum() + a.sum()), leaves)

    return step, noop


def e2e(fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def behind_sleep(fn, n=20, cycles=100_000_000):
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    enqueue = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    torch.cuda.synchronize()
    drain = (time.perf_counter() - t) * 1e3
    return enqueue, drain


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, shape in (("decoder", PRESETS["decoder"]), ("tiny", TINY)):
        step, noop = step_of(shape)
        for label, fn in (("msda step", step), ("sum-based autograd step", noop)):
            rows = [e2e(fn) for _ in range(3)]
            enq = [behind_sleep(fn) for _ in range(3)]
            print(f"{name:8s} {label:26s} e2e {sorted(rows)[1]:7.1f} us/step   behind a sleep: enqueue "
                  + ", ".join(f"{e:.1f} us/step (drain {d:.1f} ms)" for e, d in enq))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        print(f"{name:8s} synchronizing calls in one step: {len(caught)}", *[str(w.message)[:160] for w in caught])


if __name__ == "__main__":
    main()
