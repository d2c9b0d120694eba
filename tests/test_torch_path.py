"""The pure-PyTorch path (CPU and other devices) against the float64 oracle, and gradcheck."""

import pytest
import torch

import msda
from msda import ops
from msda.testing import Shape, make_inputs

from .helpers import assert_matches_reference, forward_backward, random_like_output

SHAPES = [
    Shape(batch=2, queries=11, heads=3, head_dim=8, levels=((9, 7), (5, 4), (2, 2), (1, 1)), points=4),
    Shape(batch=1, queries=6, heads=2, head_dim=24, levels=((4, 13),), points=1),
]
DTYPE_CASES = [
    (torch.float64, torch.float64),
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),  # mixed precision: float32 locations and weights
    (torch.float32, torch.float64),
]


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setattr(ops, "BACKEND", "torch")


@pytest.mark.parametrize("dtype,loc_dtype", DTYPE_CASES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, loc_dtype):
    inputs = make_inputs(shape, dtype, loc_dtype=loc_dtype, outside_fraction=0.2, seed=11)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


def test_local_distribution_matches_reference():
    shape = Shape(batch=2, queries=88, heads=2, head_dim=4, levels=((8, 8), (4, 4), (2, 2), (2, 2)), points=3)
    inputs = make_inputs(shape, torch.float32, dist="local", seed=12)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


def test_gradcheck():
    shape = Shape(batch=1, queries=3, heads=2, head_dim=3, levels=((3, 4), (2, 2)), points=2)
    inputs = make_inputs(shape, torch.float64, outside_fraction=0.2, seed=13, requires_grad=True)
    # A random location falls within eps of a cell border (a kink of bilinear interpolation,
    # where finite differences disagree with the one-sided derivative) with probability ~1e-5.
    assert torch.autograd.gradcheck(msda.multi_scale_deformable_attention, inputs.args(), eps=1e-6, atol=1e-7)
