"""GPU tier of issue 7: the operator on any CUDA device index. Every tensor lives on one GPU while
the other is current (both ways round), in float32 and bfloat16: eager, under torch.compile and
inside a CUDA graph captured on the tensors' GPU, each equal to the same computation on the other
GPU and to the float64 oracle. Inputs split across the two GPUs get the bad-input contract's
ValueError. Needs two visible GPUs (the nvidia-h200-x2 kind); skipped with that reason otherwise.
"""

import pytest
import torch

import msda
from msda.testing import PRESETS, Inputs, make_inputs, relative_error, tolerance
from msda.testing_cases import FORWARD_ARGS, bad, valid_args

from ..helpers import assert_matches_reference, forward_backward, random_like_output
from ..test_bad_input import assert_rejects

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")

SHAPE = PRESETS["decoder"]
DTYPES = (torch.float32, torch.bfloat16)
# (current device, device of the tensors): the kernels must follow the tensors, not the current device.
PLACEMENTS = pytest.mark.parametrize("current,data", [(0, 1), (1, 0)], ids=["current0-data1", "current1-data0"])


def _on(inputs: Inputs, device: str) -> Inputs:
    return Inputs(*(t.to(device) for t in inputs.args()))


def _assert_same_computation(results, elsewhere, dtype: torch.dtype) -> None:
    """Results on one GPU against the same call on the other: the forward and the location and
    weight gradients are computed without atomics, so they are bitwise equal; grad_value adds in
    the order the atomics happen to take, so the two agree to within its bound against the
    oracle (at the decoder preset bfloat16 adds natively, rounding at every add: 2.7e-3 apart)."""
    out, grad_value, grad_loc, grad_attn = results
    out1, grad_value1, grad_loc1, grad_attn1 = (t.to(out.device) for t in elsewhere)
    assert torch.equal(out, out1), relative_error(out, out1)
    assert torch.equal(grad_loc, grad_loc1), relative_error(grad_loc, grad_loc1)
    assert torch.equal(grad_attn, grad_attn1), relative_error(grad_attn, grad_attn1)
    assert relative_error(grad_value, grad_value1) <= tolerance(dtype)


def _problem(dtype: torch.dtype, device: str, seed: int = 0) -> tuple[Inputs, torch.Tensor]:
    inputs = make_inputs(SHAPE, dtype, device, seed=seed)
    return inputs, random_like_output(inputs, seed=seed + 1)


@PLACEMENTS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_on_the_other_gpu(current, data, dtype):
    inputs, grad_output = _problem(dtype, f"cuda:{data}")
    with torch.cuda.device(current):
        results = forward_backward(inputs, grad_output)
        torch.cuda.synchronize(data)
    assert all(t.device == torch.device(f"cuda:{data}") for t in results)
    assert_matches_reference(inputs, results, grad_output)
    with torch.cuda.device(current):  # the same call with every tensor on the current GPU
        on_current = forward_backward(_on(inputs, f"cuda:{current}"), grad_output.to(f"cuda:{current}"))
    _assert_same_computation(results, on_current, dtype)


@PLACEMENTS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_on_the_other_gpu(current, data, dtype):
    torch._dynamo.reset()
    compiled = torch.compile(msda.multi_scale_deformable_attention, fullgraph=True)
    inputs, grad_output = _problem(dtype, f"cuda:{data}", seed=2)
    with torch.cuda.device(current):
        results = forward_backward(inputs, grad_output, fn=compiled)
        torch.cuda.synchronize(data)
    assert_matches_reference(inputs, results, grad_output)
    eager = forward_backward(inputs, grad_output)
    _assert_same_computation(results, eager, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_captured_on_cuda1_replays_from_cuda0(dtype):
    """Forward and backward (the registered operators, as an autograd-free inference server or
    a compiled backward calls them) captured on cuda:1, replayed while cuda:0 is current."""
    static, static_grad = _problem(dtype, "cuda:1", seed=4)
    ops = torch.ops.msda

    def step():
        out = ops.forward(*static.args())
        return (out, *ops.backward(static_grad, *static.args()))

    with torch.cuda.device(1):
        side = torch.cuda.Stream()  # warm-up outside the capture: the kernels JIT-compile here
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_results = step()

    for seed in (5, 6):
        new, new_grad = _problem(dtype, "cuda:1", seed=seed)
        with torch.cuda.device(0):
            for dst, src in zip((*static.args(), static_grad), (*new.args(), new_grad)):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize(1)
        assert_matches_reference(new, static_results, new_grad)
        with torch.cuda.device(0):  # the same step eagerly on cuda:0
            on_cuda0 = _on(new, "cuda:0")
            grad0 = new_grad.to("cuda:0")
            eager = (ops.forward(*on_cuda0.args()), *ops.backward(grad0, *on_cuda0.args()))
        _assert_same_computation(static_results, eager, dtype)


SPLIT_CALLS = [
    pytest.param(case, entry, id=f"{entry}-{case.id}")
    for case in (bad(name, "on-cuda1", ValueError, lambda t: t.to("cuda:1")) for name in (*FORWARD_ARGS, "grad_output"))
    for entry in case.entries
]


@pytest.mark.parametrize("case,entry", SPLIT_CALLS)
def test_inputs_split_across_gpus_are_rejected(case, entry):
    """Every other tensor on cuda:0: a ValueError naming the argument, for every entry point."""
    assert_rejects(case, entry, valid_args("cuda:0"))
