"""Edge cases that must work and match the float64 oracle (msda.testing.reference), on the
pure-PyTorch path and through the Triton kernels (Triton's interpreter on CPU): the table
msda.testing_cases.EDGE_CASES (empty batches and query sets, one level or one point, 1x1, 1x200 and
200x1 levels, head dims that are not powers of two and up to 256, 16 heads, non-contiguous
arguments, an expanded grad_output, locations far outside [0, 1], NaN and +-inf locations (zero
contribution, finite results), int32 shapes), and the same dimensions fuzzed.

tests/gpu/test_gpu_bad_input.py runs the table on CUDA, scripts/sanitize.py under compute-sanitizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import msda
from msda import ops
from msda.testing import Inputs, Shape
from msda.testing_cases import BASE, EDGE_CASES, EdgeCase

from .helpers import assert_matches_reference


def run(inputs: Inputs, grad_output: Tensor):
    """Output and gradients through autograd, the arguments passed as they are (views stay views)."""
    value, loc, attn = (
        t.detach().requires_grad_() for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    )
    out = msda.multi_scale_deformable_attention(value, inputs.spatial_shapes, inputs.level_start_index, loc, attn)
    out.backward(grad_output)
    return out.detach(), value.grad, loc.grad, attn.grad


def check_case(case: EdgeCase, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> None:
    """The case through the current backend matches the oracle (finite, right shapes, zero
    gradients for an empty call); with views or an expanded grad_output, so does a direct call
    of torch.ops.msda.backward (autograd may hand the operator another layout)."""
    inputs, grad_output = case.build(dtype, device, seed)
    if case.views:
        assert not any(t.is_contiguous() for t in (*inputs.args(), grad_output))
    results = run(inputs, grad_output)
    assert_matches_reference(inputs, results, grad_output)
    B, Q, M, D = case.shape.batch, case.shape.queries, case.shape.heads, case.shape.head_dim
    assert results[0].shape == (B, Q, M * D)
    if B * Q == 0:
        assert all(torch.count_nonzero(g) == 0 for g in results[1:])
    if case.views or case.expanded_grad:
        grads = torch.ops.msda.backward(grad_output, *inputs.args())
        assert_matches_reference(inputs, (results[0], *grads), grad_output)


@contextlib.contextmanager
def backend(name: str):
    """msda.ops.BACKEND set to `name` ("triton" on CPU: Triton's interpreter)."""
    previous = ops.BACKEND
    ops.BACKEND = name
    try:
        yield
    finally:
        ops.BACKEND = previous


# The Triton path of these CPU tests is the interpreter; on a GPU machine tests/gpu runs the kernels.
needs_interpreter = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not (ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"), reason="no interpreter"),
]
# (backend, dtype): the torch path in float32 and float64, the interpreter in float32.
PATHS = [
    pytest.param("torch", torch.float32, id="torch-float32"),
    pytest.param("torch", torch.float64, id="torch-float64"),
    pytest.param("triton", torch.float32, id="interpreter-float32", marks=needs_interpreter),
]


@pytest.mark.parametrize("path,dtype", PATHS)
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda case: case.id)
def test_edge_case_matches_reference(case, path, dtype):
    with backend(path):
        check_case(case, dtype)


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_non_finite_locations_contribute_nothing(path):
    """A sample at NaN or +-inf adds nothing and gets zero gradients: the output equals that
    of the same call with its attention weight zeroed."""
    inputs, grad_output = EdgeCase("nan", BASE, special="nonfinite").build()
    bad = ~torch.isfinite(inputs.sampling_locations).all(-1)
    assert bad.any() and not bad.all()
    with backend(path):
        out, _, grad_loc, grad_attn = run(inputs, grad_output)
        zeroed = dataclasses.replace(inputs, attention_weights=inputs.attention_weights.masked_fill(bad, 0))
        expected = run(zeroed, grad_output)[0]
    torch.testing.assert_close(out, expected)
    assert torch.count_nonzero(grad_loc[bad]) == 0 and torch.count_nonzero(grad_attn[bad]) == 0


# The edge dimensions fuzzed together: empty batches and query sets, 1x1 levels, odd head dims,
# locations outside [0, 1] and non-finite ones. Examples per test: the hypothesis profile of
# tests/conftest.py (HYPOTHESIS_PROFILE=thorough for more).
@st.composite
def edge_cases(draw) -> EdgeCase:
    levels = draw(st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=3))
    shape = Shape(
        batch=draw(st.integers(0, 3)),
        queries=draw(st.integers(0, 9)),
        heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([1, 3, 8, 24, 32])),
        levels=tuple(levels),
        points=draw(st.integers(1, 3)),
    )
    return EdgeCase(
        "fuzz",
        shape,
        outside_fraction=draw(st.floats(0, 1)),
        special=draw(st.sampled_from(["", "nonfinite"])),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
    )


@given(case=edge_cases(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_fuzz_torch_path(case, dtype, seed):
    with backend("torch"):
        check_case(case, dtype, seed=seed)


@pytest.mark.interpreter
@pytest.mark.skipif(not (ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"), reason="no interpreter")
@given(case=edge_cases(), seed=st.integers(0, 2**16))
def test_fuzz_interpreter(case, seed):
    with backend("triton"):
        check_case(case, torch.float32, seed=seed)
