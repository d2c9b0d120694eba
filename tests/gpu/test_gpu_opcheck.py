"""GPU tier: torch.library.opcheck passes for msda::forward and msda::backward on CUDA tensors,
every default test (schema, autograd registration, fake tensor, AOT dispatch with dynamic
shapes), so the fake implementations match what the Triton kernels return."""

import pytest
import torch

from msda.testing import Shape, make_inputs

from ..helpers import random_like_output

# Small and uneven: no size is a power of two or equal to another, K is odd.
SHAPE = Shape(batch=3, queries=7, heads=2, head_dim=8, levels=((6, 5), (3, 3)), points=3)
# float32 and float64 only: test_aot_dispatch_dynamic compares two runs of the atomic backward
# with assert_close's default tolerance, which half-precision atomics (order-dependent rounding
# of sums that cancel) can miss without anything being wrong.
CASES = [(torch.float32, torch.int64), (torch.float64, torch.int64), (torch.float32, torch.int32)]


def _inputs(dtype, index_dtype, requires_grad):
    inputs = make_inputs(SHAPE, dtype, "cuda", requires_grad=requires_grad, seed=5)
    inputs.spatial_shapes = inputs.spatial_shapes.to(index_dtype)
    inputs.level_start_index = inputs.level_start_index.to(index_dtype)
    return inputs


@pytest.mark.parametrize("dtype,index_dtype", CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_opcheck_forward_on_cuda(dtype, index_dtype):
    inputs = _inputs(dtype, index_dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.msda.forward.default, inputs.args())


@pytest.mark.parametrize("dtype,index_dtype", CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_opcheck_backward_on_cuda(dtype, index_dtype):
    inputs = _inputs(dtype, index_dtype, requires_grad=False)
    grad_output = random_like_output(inputs)
    torch.library.opcheck(torch.ops.msda.backward.default, (grad_output, *inputs.args()))
    # out.sum().backward() hands the backward an expanded, stride-0 grad_output.
    expanded = grad_output.new_ones(()).expand(grad_output.shape)
    torch.library.opcheck(torch.ops.msda.backward.default, (expanded, *inputs.args()))
