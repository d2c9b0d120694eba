"""Under load (issue 15, item 8), on CPU: eight threads calling the operator at once, forward and
backward, each on its own inputs, get exactly the results of the same calls made one after
another (the pure-PyTorch path is deterministic, so bitwise). tests/gpu/test_gpu_under_load.py
runs threads on their own CUDA streams, 10,000 calls for flat memory, and out-of-memory."""

from __future__ import annotations

import threading

import torch

from msda.testing import Shape, make_inputs

from .helpers import forward_backward, random_like_output

THREADS = 8
SHAPES = [
    Shape(batch=b, queries=q, heads=m, head_dim=d, levels=((7, 9), (4, 5), (1, 1)), points=k)
    for b, q, m, d, k in [(1, 20, 2, 8, 2), (2, 11, 3, 5, 3), (3, 7, 1, 16, 1), (1, 33, 4, 4, 4)]
]


def problems(device="cpu", dtype=torch.float32):
    """THREADS different calls: their inputs and grad_outputs."""
    out = []
    for i in range(THREADS):
        inputs = make_inputs(SHAPES[i % len(SHAPES)], dtype, device, outside_fraction=0.2, seed=i)
        out.append((inputs, random_like_output(inputs, seed=100 + i)))
    return out


def run_concurrently(work, count=THREADS):
    """Run work(i) for i < count in `count` threads started together; the results by i."""
    results, errors = [None] * count, []
    barrier = threading.Barrier(count)

    def body(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_threads_get_the_results_of_serial_calls():
    calls = problems()
    serial = [forward_backward(inputs, grad) for inputs, grad in calls]
    for _ in range(3):  # a few rounds, so that the calls overlap in different ways
        concurrent = run_concurrently(lambda i: forward_backward(*calls[i]))
        for i, (got, want) in enumerate(zip(concurrent, serial)):
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"thread {i}"
