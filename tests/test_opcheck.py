"""torch.library.opcheck of the four operators (msda::forward, msda::backward and their softmax
forms): schema, autograd registration, fake tensors and AOT dispatch with dynamic shapes, on the
pure-PyTorch path and through the Triton kernels."""

import pytest
import torch

from msda import ops
from msda.testing import Shape, make_inputs

SHAPE = Shape(batch=2, queries=4, heads=2, head_dim=4, levels=((4, 3), (2, 2)), points=2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(params=["torch", "triton"])
def test_utils(request, monkeypatch):
    """opcheck's tests for the backend: all of them, except that Triton's CPU interpreter runs a
    kernel even while AOT dispatch traces with fake tensors (and fails reading their storage), so
    there test_aot_dispatch_dynamic is left to the GPU tier, which runs every test on CUDA."""
    monkeypatch.setattr(ops, "BACKEND", request.param)
    if request.param == "triton" and DEVICE == "cpu":
        return ALL_TESTS[:3]
    return ALL_TESTS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward(test_utils, dtype):
    inputs = make_inputs(SHAPE, dtype, DEVICE, outside_fraction=0.2, seed=31, requires_grad=True)
    torch.library.opcheck(torch.ops.msda.forward.default, inputs.args(), test_utils=test_utils)


def test_backward(test_utils):
    inputs = make_inputs(SHAPE, torch.float32, DEVICE, seed=32)
    grad_output = torch.randn(SHAPE.batch, SHAPE.queries, SHAPE.heads * SHAPE.head_dim, device=DEVICE)
    torch.library.opcheck(torch.ops.msda.backward.default, (grad_output, *inputs.args()), test_utils=test_utils)


def test_backward_expanded_grad_output(test_utils):
    """`out.sum().backward()` hands the backward a stride-0 grad_output."""
    inputs = make_inputs(SHAPE, torch.float32, DEVICE, seed=33)
    grad_output = torch.ones((), device=DEVICE).expand(SHAPE.batch, SHAPE.queries, SHAPE.heads * SHAPE.head_dim)
    torch.library.opcheck(torch.ops.msda.backward.default, (grad_output, *inputs.args()), test_utils=test_utils)


# The softmax operators: logits in place of the weights.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_softmax(test_utils, dtype):
    inputs = make_inputs(SHAPE, dtype, DEVICE, outside_fraction=0.2, seed=34, requires_grad=True, logits=True)
    torch.library.opcheck(torch.ops.msda.forward_softmax.default, inputs.args(), test_utils=test_utils)


def test_backward_softmax(test_utils):
    inputs = make_inputs(SHAPE, torch.float32, DEVICE, seed=35, logits=True)
    grad_output = torch.randn(SHAPE.batch, SHAPE.queries, SHAPE.heads * SHAPE.head_dim, device=DEVICE)
    torch.library.opcheck(
        torch.ops.msda.backward_softmax.default, (grad_output, *inputs.args()), test_utils=test_utils
    )


def test_backward_softmax_expanded_grad_output(test_utils):
    inputs = make_inputs(SHAPE, torch.float32, DEVICE, seed=36, logits=True)
    grad_output = torch.ones((), device=DEVICE).expand(SHAPE.batch, SHAPE.queries, SHAPE.heads * SHAPE.head_dim)
    torch.library.opcheck(
        torch.ops.msda.backward_softmax.default, (grad_output, *inputs.args()), test_utils=test_utils
    )
