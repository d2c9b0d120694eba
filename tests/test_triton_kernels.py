"""The Triton kernels against the float64 oracle: in Triton's interpreter on a CPU-only machine
(TRITON_INTERPRET=1, set by conftest.py), compiled on CUDA where a GPU is present."""

import pytest
import torch

from msda import ops
from msda.kernels import backward as backward_kernel
from msda.kernels import forward as forward_kernel
from msda.testing import Shape, make_inputs

from .helpers import assert_matches_reference, forward_backward, random_like_output

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter

# Small: the interpreter runs every program in numpy. D=6 and L*K=6 are not powers of two.
SHAPE = Shape(batch=2, queries=5, heads=2, head_dim=6, levels=((5, 6), (3, 2), (1, 1)), points=2)
# Few samples per value row: the rule keeps float16 gradients on native float16 atomics here.
SPARSE = Shape(batch=1, queries=2, heads=2, head_dim=8, levels=((12, 10),), points=2)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setattr(ops, "BACKEND", "triton")


def check(inputs):
    grad_output = random_like_output(inputs)
    return assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_forward_and_backward(dtype):
    check(make_inputs(SHAPE, dtype, DEVICE, outside_fraction=0.25, seed=21))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_mixed_precision(dtype):
    check(make_inputs(SHAPE, dtype, DEVICE, loc_dtype=torch.float32, seed=22))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_grad_value_accumulator(dtype):
    """Both accumulators meet the bounds: native half atomics where the rule picks them (float16
    on sparse samples; the interpreter has no bfloat16 atomic add), float32 otherwise."""
    device = torch.device(DEVICE)
    for shape, sparse in ((SPARSE, True), (SHAPE, False)):
        picked = backward_kernel.grad_value_accumulator_dtype(
            dtype, device, shape.queries, shape.num_values, len(shape.levels), shape.points
        )
        native_expected = sparse and (dtype == torch.float16 or device.type == "cuda")
        assert picked == (dtype if native_expected else torch.float32)
        check(make_inputs(shape, dtype, DEVICE, seed=23))


def test_int64_indices(monkeypatch):
    """The 64-bit index path (taken when a tensor passes 2**31 elements) computes the same."""
    monkeypatch.setattr(ops, "_needs_int64", lambda *tensors: True)
    check(make_inputs(SHAPE, torch.float32, DEVICE, outside_fraction=0.25, seed=24))


@pytest.mark.parametrize("max_block_lk", [4, 64])
def test_forward_in_sample_steps(monkeypatch, max_block_lk):
    """The forward walks L*K in steps of BLOCK_LK samples; a step that does not divide L*K masks."""
    monkeypatch.setattr(forward_kernel, "FORWARD_MAX_BLOCK_LK", max_block_lk)
    monkeypatch.setattr(forward_kernel, "FORWARD_TILE_BYTES", 256)
    check(make_inputs(SHAPE, torch.float32, DEVICE, outside_fraction=0.25, seed=25))


def test_local_distribution():
    shape = Shape(batch=1, queries=28, heads=2, head_dim=4, levels=((4, 5), (2, 3), (1, 2)), points=2)
    assert shape.queries == shape.num_values  # an encoder: every pixel is a query
    check(make_inputs(shape, torch.float32, DEVICE, dist="local", seed=26))
