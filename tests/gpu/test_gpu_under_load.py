"""GPU tier of issue 15, item 8: the operator under load.

- Eight threads, each on its own CUDA stream, calling forward and backward at once get the
  results of the same calls made one after another: the forward and the location and weight
  gradients bitwise (no atomics), grad_value within the dtype's bound (atomic adds land in
  another order).
- 10,000 forward + backward calls leave allocated memory where it was, and never take more
  than one call does.
- A call too large for the GPU raises torch.OutOfMemoryError (forward and backward), frees
  what it took, and the next call works. Its tensors are stride-0 expansions, so the test
  itself takes almost no memory (other tests may run beside it).
"""

import pytest
import torch

import msda
from msda.testing import PRESETS, Shape, make_inputs, relative_error, tolerance

from ..helpers import assert_matches_reference, forward_backward, random_like_output
from ..test_under_load import THREADS, run_concurrently

SHAPE = PRESETS["decoder"]


def _calls(dtype):
    calls = []
    for i in range(THREADS):
        inputs = make_inputs(SHAPE, dtype, "cuda", outside_fraction=0.1, seed=40 + i)
        calls.append((inputs, random_like_output(inputs, seed=60 + i)))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_threads_on_their_own_streams_get_the_serial_results(dtype):
    calls = _calls(dtype)
    serial = [forward_backward(inputs, grad) for inputs, grad in calls]
    torch.cuda.synchronize()

    def on_own_stream(i):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.default_stream())  # the inputs were made there
        with torch.cuda.stream(stream):
            results = forward_backward(*calls[i])
        stream.synchronize()
        return results, stream

    for _ in range(3):
        concurrent = run_concurrently(on_own_stream)
        assert len({id(stream) for _, stream in concurrent}) == THREADS
        for i, ((out, grad_value, grad_loc, grad_attn), _) in enumerate(concurrent):
            s_out, s_value, s_loc, s_attn = serial[i]
            assert torch.equal(out, s_out), f"thread {i}: {relative_error(out, s_out)}"
            assert torch.equal(grad_loc, s_loc), f"thread {i}: {relative_error(grad_loc, s_loc)}"
            assert torch.equal(grad_attn, s_attn), f"thread {i}: {relative_error(grad_attn, s_attn)}"
            assert relative_error(grad_value, s_value) <= tolerance(dtype), f"thread {i}"
    for (inputs, grad), results in zip(calls, (c[0] for c in concurrent)):
        assert_matches_reference(inputs, results, grad)


def test_10000_calls_leave_allocated_memory_flat():
    inputs = make_inputs(SHAPE, torch.float32, "cuda", seed=70, requires_grad=True)
    grad_output = random_like_output(inputs)
    leaves = (inputs.value, inputs.sampling_locations, inputs.attention_weights)

    def call():
        out = msda.multi_scale_deformable_attention(*inputs.args())
        out.backward(grad_output)
        for t in leaves:
            t.grad = None

    for _ in range(5):  # warm-up: kernels compiled, allocator blocks cached
        call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    one_call_peak = torch.cuda.max_memory_allocated()
    assert torch.cuda.memory_allocated() == base

    torch.cuda.reset_peak_memory_stats()
    for _ in range(10_000):
        call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
    assert torch.cuda.max_memory_allocated() <= one_call_peak


def _too_large(kind: str):
    """Arguments of a call whose output (forward) or grad_value (backward) needs 1.5x the GPU's
    memory, built from stride-0 expansions of tiny tensors."""
    _, total = torch.cuda.mem_get_info()
    D, levels = 2048, ((2, 2),)
    shapes = torch.tensor(levels, device="cuda")
    starts = torch.tensor([0], device="cuda")
    if kind == "forward":
        Q = 3 * total // (2 * 4 * D) + 1  # float32 output of Q x D
        value = torch.randn(1, 4, 1, D, device="cuda")
        loc = torch.rand(1, 1, 1, 1, 1, 2, device="cuda").expand(1, Q, 1, 1, 1, 2)
        attn = torch.rand(1, 1, 1, 1, 1, device="cuda").expand(1, Q, 1, 1, 1)
        return value, shapes, starts, loc, attn
    S = 3 * total // (2 * 4 * D) + 1  # grad_value of S x D in float32
    levels = ((S, 1),)
    shapes = torch.tensor(levels, device="cuda")
    value = torch.randn(1, 1, 1, D, device="cuda").expand(1, S, 1, D)
    loc = torch.rand(1, 4, 1, 1, 1, 2, device="cuda")
    attn = torch.rand(1, 4, 1, 1, 1, device="cuda")
    grad_output = torch.randn(1, 4, D, device="cuda")
    return grad_output, value, shapes, starts, loc, attn


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_call_too_large_raises_out_of_memory_and_the_next_call_works(kind):
    torch.cuda.synchronize()
    args = _too_large(kind)
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError):
        getattr(torch.ops.msda, kind)(*args)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    del args

    inputs = make_inputs(Shape(2, 50, 4, 32, ((20, 30), (10, 15)), 4), torch.float32, "cuda", seed=80)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)
