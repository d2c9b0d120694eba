"""GPU tier of tests/test_non_finite_weights.py: a non-finite attention weight makes its (batch,
query, head) output NaN, with the gradients docs/correctness.md gives, through the compiled
Triton kernels and the pure-PyTorch path on CUDA, in every dtype."""

import pytest

from ..test_edge_cases import backend
from ..test_non_finite_weights import DTYPES, KINDS, build, check


def cases():
    for path in ("triton", "torch"):
        for dtype in DTYPES:
            for kind in KINDS:
                yield pytest.param(path, dtype, kind, id=f"{path}-{str(dtype)[6:]}-{kind}")


@pytest.mark.parametrize("path,dtype,kind", cases())
def test_non_finite_weight_makes_its_output_nan_on_cuda(path, dtype, kind):
    with backend(path):
        check(build(dtype, kind, device="cuda", seed=1))
