"""Non-finite attention weights (issue 15, item 4; docs/correctness.md): a weight of NaN, +inf
or -inf on any sample makes the output of its (batch, query, head) NaN, in all D channels,
whether the sample lands inside its level, outside it, or at a non-finite location. Gradients:

- grad_value: NaN in the rows that the affected sample's inside corners read, all D channels
  of its head; a sample that touches no pixel adds nothing;
- grad_sampling_locations: NaN in both coordinates of the affected sample, and nowhere else;
- grad_attention_weights: finite everywhere (it does not depend on the weights);
- everything else as if the affected weights were 0 (within the dtype's bound of the oracle).

Checked on the pure-PyTorch path and through the Triton kernels (the interpreter on CPU;
tests/gpu/test_gpu_non_finite.py on CUDA), in every dtype, by NaN position and value: both
paths against the same expected NaN masks, so they agree on where the NaNs are.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from msda import torch_impl
from msda.testing import Inputs, Shape, make_inputs, reference_with_grads, relative_error, tolerance

from .test_edge_cases import backend, needs_interpreter, run

SHAPE = Shape(batch=2, queries=5, heads=3, head_dim=4, levels=((3, 4), (2, 3), (1, 1)), points=2)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
KINDS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@dataclasses.dataclass
class Problem:
    inputs: Inputs
    grad_output: torch.Tensor
    affected: torch.Tensor  # (B, Q, M, L, K) bool: the samples with a non-finite weight


def build(dtype: torch.dtype, kind: str, device="cpu", seed: int = 0, shape: Shape = SHAPE) -> Problem:
    """Locations: a third outside [0, 1], a fifth of the samples at NaN or +-inf; one sample in
    eight gets a `kind` weight, among them some inside, some outside, some at non-finite
    locations."""
    inputs = make_inputs(shape, dtype, outside_fraction=0.3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    loc = inputs.sampling_locations
    samples = loc.shape[:-1]
    non_finite_loc = torch.rand(samples, generator=gen) < 0.2
    specials = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=loc.dtype)
    pick = specials[torch.randint(0, 3, samples, generator=gen)]
    loc = torch.where(non_finite_loc.unsqueeze(-1), pick.unsqueeze(-1), loc)
    affected = torch.rand(samples, generator=gen) < 1 / 8
    attn = inputs.attention_weights.masked_fill(affected, KINDS[kind])
    B, Q, M = samples[:3]
    grad_output = torch.randn(B, Q, M * shape.head_dim, generator=gen).to(dtype)

    def place(t):
        return t.to(device)

    inputs = Inputs(
        value=place(inputs.value),
        spatial_shapes=place(inputs.spatial_shapes),
        level_start_index=place(inputs.level_start_index),
        sampling_locations=place(loc),
        attention_weights=place(attn),
    )
    return Problem(inputs, place(grad_output), place(affected))


def rows_read_by(inputs: Inputs, samples: torch.Tensor) -> torch.Tensor:
    """(B, S, M, D) bool: the value rows that the inside corners of `samples` (a (B, Q, M, L, K)
    mask) read, from the definition: x_im = x * W - 0.5, corners floor(x_im) and floor(x_im) + 1
    (and likewise in y), inside when 0 <= corner < size; non-finite locations read nothing."""
    B, S, M, D = inputs.value.shape
    loc = inputs.sampling_locations.detach().double().cpu()
    samples = samples.cpu()
    read = torch.zeros(B, S, M, dtype=torch.bool)
    start = 0
    for level, (h, w) in enumerate(inputs.spatial_shapes.tolist()):
        x = loc[:, :, :, level, :, 0] * w - 0.5
        y = loc[:, :, :, level, :, 1] * h - 0.5
        finite = torch.isfinite(x) & torch.isfinite(y) & samples[:, :, :, level]
        x0 = torch.where(finite, x, -10).floor().long()
        y0 = torch.where(finite, y, -10).floor().long()
        b, _, m, _ = torch.meshgrid(*(torch.arange(n) for n in x.shape), indexing="ij")
        for cx in (x0, x0 + 1):
            for cy in (y0, y0 + 1):
                inside = finite & (cx >= 0) & (cx < w) & (cy >= 0) & (cy < h)
                read[b[inside], (start + cy * w + cx)[inside], m[inside]] = True
        start += h * w
    return read.unsqueeze(-1).expand(B, S, M, D)


def expected_results(problem: Problem):
    """(NaN masks, float64 oracle values) of the four results. The oracle with the affected
    weights set to 0 gives every value that is not NaN."""
    inputs, affected = problem.inputs, problem.affected
    zeroed = dataclasses.replace(inputs, attention_weights=inputs.attention_weights.masked_fill(affected, 0))
    values = reference_with_grads(zeroed, problem.grad_output)
    B, Q, M = affected.shape[:3]
    D = inputs.value.shape[-1]
    nan_out = affected.any(-1).any(-1).unsqueeze(-1).expand(B, Q, M, D).reshape(B, Q, M * D)
    nan_value = rows_read_by(inputs, affected)
    nan_loc = affected.unsqueeze(-1).expand(inputs.sampling_locations.shape)
    nan_attn = torch.zeros_like(affected)
    masks = tuple(m.cpu() for m in (nan_out, nan_value, nan_loc, nan_attn))
    return masks, values


def check(problem: Problem) -> None:
    inputs, affected = problem.inputs, problem.affected
    loc = inputs.sampling_locations
    in_image = ((loc >= 0) & (loc <= 1)).all(-1)
    non_finite = ~torch.isfinite(loc).all(-1)
    # The problem has affected samples inside, outside and at non-finite locations.
    assert (affected & in_image).any() and (affected & ~in_image & ~non_finite).any() and (affected & non_finite).any()
    assert (~affected).any(-1).any(-1).any()  # and unaffected (batch, query, head) outputs

    results = run(inputs, problem.grad_output)
    masks, expected = expected_results(problem)
    bound = tolerance(inputs.value.dtype)
    names = ("output", "grad_value", "grad_sampling_locations", "grad_attention_weights")
    for name, actual, nan_mask, want in zip(names, results, masks, expected):
        actual = actual.cpu()
        assert not actual.isinf().any(), f"{name}: inf where NaN or a finite value is expected"
        wrong = actual.isnan() != nan_mask
        assert not wrong.any(), f"{name}: NaN at {wrong.nonzero()[:5].tolist()}... ({int(wrong.sum())} wrong)"
        error = relative_error(actual[~nan_mask], want.cpu()[~nan_mask])
        assert error <= bound, f"{name}: relative error {error:.1e} > {bound:.1e} where finite"
    assert masks[0].any() and masks[1].any() and masks[2].any()  # something was NaN


def cases():
    for path in ("torch", "triton"):
        for dtype in DTYPES:
            for kind in KINDS:
                marks = list(needs_interpreter) if path == "triton" else []
                yield pytest.param(path, dtype, kind, marks=marks, id=f"{path}-{str(dtype)[6:]}-{kind}")


@pytest.mark.parametrize("path,dtype,kind", cases())
def test_non_finite_weight_makes_its_output_nan(path, dtype, kind):
    with backend(path):
        check(build(dtype, kind))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_non_finite_weight_with_grad_value_by_cells(dtype, kind, monkeypatch):
    """The CPU path's grad_value summed by each sample's top-left cell (what dense shapes take;
    this shape's density picks the sum by row): NaN reaches only the rows its inside corners read."""
    monkeypatch.setattr(torch_impl, "CELL_SUMS_MIN_CORNERS_PER_CELL", 0)
    with backend("torch"):
        check(build(dtype, kind))
