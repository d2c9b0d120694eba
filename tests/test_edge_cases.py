"""Edge cases that must work and match the float64 oracle (msda.testing.reference), on the
pure-PyTorch path and through the Triton kernels (Triton's interpreter on CPU): empty batches and
query sets, one level or one point, 1x1, 1x200 and 200x1 levels, head dims that are not powers of
two and up to 256, 16 heads, non-contiguous arguments, an expanded grad_output, locations far
outside [0, 1], NaN and +-inf locations (zero contribution, finite results), int32 shapes.

EDGE_CASES is reused by tests/gpu/test_gpu_bad_input.py (on CUDA) and scripts/sanitize.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import msda
from msda import ops
from msda.testing import Inputs, Shape, make_inputs

from .helpers import assert_matches_reference

FAR = (-1e6, 1e6, -1e30, 1e30, -3.0, 5.0)  # float16 rounds the large ones to +-inf: also valid
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class EdgeCase:
    id: str
    shape: Shape
    outside_fraction: float = 0.0  # of the locations moved just outside [0, 1] (make_inputs)
    # Then a third of the coordinates replaced: "far" (FAR), "nonfinite" (NaN, +-inf), or
    # "edges" (all coordinates on 0, 1, pixel centres or pixel borders).
    special: str = ""
    views: bool = False  # every argument (and grad_output) a non-contiguous view
    expanded_grad: bool = False  # grad_output expanded from (1, 1, M * D): stride 0 along B and Q
    index_dtype: torch.dtype = torch.int64  # of spatial_shapes and level_start_index

    def build(self, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> tuple[Inputs, Tensor]:
        """The case's inputs on `device` and a grad_output for its backward."""
        inputs = make_inputs(self.shape, dtype, outside_fraction=self.outside_fraction, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        loc = _special_locations(inputs.sampling_locations, self.special, self.shape, gen)
        B, Q, M, D = self.shape.batch, self.shape.queries, self.shape.heads, self.shape.head_dim
        grad_shape = (1, 1, M * D) if self.expanded_grad else (B, Q, M * D)
        grad_output = torch.randn(grad_shape, generator=gen).to(device=device, dtype=dtype)
        if self.expanded_grad:
            grad_output = grad_output.expand(B, Q, M * D)
        elif self.views:
            grad_output = _spread(grad_output.transpose(0, 1)).transpose(0, 1)

        def place(t: Tensor, dt: torch.dtype, first_dims_swapped: bool = False) -> Tensor:
            t = t.to(device=device, dtype=dt)
            if not self.views:
                return t
            if first_dims_swapped:  # a (S, B, ...) buffer seen as (B, S, ...), as DETR code does
                return _spread(t.transpose(0, 1)).transpose(0, 1)
            return _spread(t)

        loc_dtype = inputs.sampling_locations.dtype
        inputs = Inputs(
            value=place(inputs.value, dtype, first_dims_swapped=True),
            spatial_shapes=place(inputs.spatial_shapes, self.index_dtype),
            level_start_index=place(inputs.level_start_index, self.index_dtype),
            sampling_locations=place(loc, loc_dtype),
            attention_weights=place(inputs.attention_weights, loc_dtype),
        )
        return inputs, grad_output


def _spread(t: Tensor) -> Tensor:
    """`t`'s values in a non-contiguous view: every other element of a buffer twice as wide."""
    buffer = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    view = buffer[..., ::2]
    view.copy_(t)
    return view


def _special_locations(loc: Tensor, special: str, shape: Shape, gen: torch.Generator) -> Tensor:
    if not special:
        return loc
    if special == "edges":
        # 0, 1, and per level the pixel borders i / W and centres (i + 0.5) / W (and likewise in y):
        # integer and half-integer pixel positions, where floor() and the bilinear weights are exact.
        sizes = torch.tensor(shape.levels, dtype=torch.float64).flip(1).view(1, 1, 1, -1, 1, 2)  # (W, H)
        steps = torch.randint(0, 2 * 7 + 1, loc.shape, generator=gen).to(torch.float64) / 2
        on_grid = (steps / sizes).clamp(0, 1)
        ends = torch.randint(0, 2, loc.shape, generator=gen).to(torch.float64)
        pick_end = torch.rand(loc.shape, generator=gen) < 0.2
        return torch.where(pick_end, ends, on_grid).to(loc.dtype)
    choices = {"far": FAR, "nonfinite": NON_FINITE}[special]
    replaced = torch.rand(loc.shape, generator=gen) < 1 / 3
    picks = torch.tensor(choices, dtype=torch.float64)[torch.randint(0, len(choices), loc.shape, generator=gen)]
    return torch.where(replaced, picks.to(loc.dtype), loc)


BASE = Shape(batch=2, queries=3, heads=2, head_dim=4, levels=((3, 4), (2, 2)), points=2)

# Interpreter-sized shapes: Triton's interpreter runs each program in NumPy, ~0.05 s apiece.
EDGE_CASES = [
    EdgeCase("empty-batch", dataclasses.replace(BASE, batch=0)),
    EdgeCase("empty-queries", dataclasses.replace(BASE, queries=0)),
    EdgeCase("empty-batch-and-queries", dataclasses.replace(BASE, batch=0, queries=0)),
    EdgeCase("one-level-one-point", Shape(2, 3, 2, 4, ((5, 6),), 1), outside_fraction=0.3),
    EdgeCase("one-point", dataclasses.replace(BASE, points=1), outside_fraction=0.3),
    EdgeCase("1x1-levels", Shape(2, 4, 2, 4, ((1, 1), (1, 1), (2, 1)), 3), outside_fraction=0.3),
    EdgeCase("1x1-only", Shape(1, 5, 1, 4, ((1, 1),), 1), outside_fraction=0.3),
    EdgeCase("1x1-edges", Shape(1, 5, 2, 4, ((1, 1), (1, 2)), 2), special="edges"),
    EdgeCase("wide-and-tall", Shape(1, 6, 2, 8, ((1, 200), (200, 1)), 2), outside_fraction=0.2),
    *[
        EdgeCase(f"head-dim-{d}", Shape(1, 3, 2, d, ((3, 4), (2, 2)), 2), outside_fraction=0.2)
        for d in (1, 3, 24, 48, 96)
    ],
    EdgeCase("head-dim-256", Shape(1, 3, 1, 256, ((3, 4), (2, 2)), 2), outside_fraction=0.2),
    EdgeCase("16-heads", Shape(1, 2, 16, 8, ((3, 4), (2, 2)), 2), outside_fraction=0.2),
    EdgeCase("query-blocks", Shape(1, 70, 1, 4, ((3, 4),), 2), outside_fraction=0.2),  # > one BLOCK_Q
    EdgeCase("non-contiguous", BASE, outside_fraction=0.3, views=True),
    EdgeCase("expanded-grad-output", BASE, outside_fraction=0.3, expanded_grad=True),
    EdgeCase("edges", BASE, special="edges"),
    EdgeCase("far-outside", BASE, special="far"),
    EdgeCase("non-finite", BASE, outside_fraction=0.3, special="nonfinite"),
    EdgeCase("int32-shapes", BASE, outside_fraction=0.3, index_dtype=torch.int32),
    EdgeCase(
        "all-at-once",
        Shape(2, 3, 3, 24, ((1, 1), (1, 9), (7, 1)), 3),
        outside_fraction=0.3,
        special="nonfinite",
        views=True,
        expanded_grad=True,
        index_dtype=torch.int32,
    ),
]


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
