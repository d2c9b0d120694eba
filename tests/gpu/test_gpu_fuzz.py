"""GPU tier of issue 15, item 9: hypothesis fuzzing of the compiled Triton kernels against the
float64 oracle, forward and backward, at least 500 examples per dtype (MSDA_GPU_FUZZ_EXAMPLES
overrides the count; the test asserts that many ran).

Drawn wide: batch 0-4, 1-400 queries, 1-9 heads, 1-5 levels of 1-48 x 1-48 pixels (1x1 levels
included), locations uniform with any fraction just outside
[0, 1], then a third replaced by far-outside, non-finite or pixel-border values, non-contiguous
arguments, expanded (stride-0) grad_outputs, int32 or int64 level tables. (L, K, D) come from
KERNEL_SHAPES: each distinct (L, K, D) and each divisibility class of Q, S, M and D (Triton
specializes integer arguments that are 1 or multiples of 16) is a separate kernel compile of
about a second, so drawing them freely would spend the run compiling. KERNEL_SHAPES covers L
from 1 to 5, K from 1 to 8 and D from 1 to 256, powers of two and not.

Run it on its own, one process per dtype:

    python3 -m pytest tests/gpu/test_gpu_fuzz.py -q -s -n 4 --timeout=1800
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msda.testing import Shape

from ..test_edge_cases import EdgeCase, backend, check_case

EXAMPLES = int(os.environ.get("MSDA_GPU_FUZZ_EXAMPLES", "500"))
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_SHAPES = ((1, 1, 1), (4, 4, 32), (3, 2, 24), (2, 3, 33), (5, 2, 256), (1, 8, 96), (4, 5, 3))


@st.composite
def gpu_cases(draw) -> EdgeCase:
    L, K, D = draw(st.sampled_from(KERNEL_SHAPES))
    side = st.integers(1, 48)
    levels = tuple(draw(st.lists(st.tuples(side, side), min_size=L, max_size=L)))
    shape = Shape(
        batch=draw(st.integers(0, 4)),
        queries=draw(st.integers(1, 400)),
        heads=draw(st.integers(1, 9)),
        head_dim=D,
        levels=levels,
        points=K,
    )
    # Views of every argument where each has a strided last dim to make non-contiguous (as
    # check_case asserts); others arrive contiguous.
    can_view = shape.batch >= 1 and shape.queries >= 2 and D >= 2 and L >= 2 and K >= 2
    return EdgeCase(
        "gpu-fuzz",
        shape,
        outside_fraction=draw(st.floats(0, 1)),
        special=draw(st.sampled_from(["", "far", "nonfinite", "edges"])),
        views=can_view and draw(st.booleans()),
        expanded_grad=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fuzz_kernels_against_the_oracle(dtype):
    seen = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=gpu_cases(), seed=st.integers(0, 2**16))
    def fuzz(case, seed):
        seen.append(case.shape)
        check_case(case, dtype, "cuda", seed)

    with backend("triton"):
        fuzz()
    kernels = {(len(s.levels), s.points, s.head_dim) for s in seen}
    print(f"\nGPU fuzz {str(dtype)[6:]}: {len(seen)} examples, {len(kernels)} (L, K, D), "
          f"{sum(s.batch * s.queries == 0 for s in seen)} empty, {max(s.queries for s in seen)} max queries")
    assert len(seen) >= EXAMPLES
