"""GPU tier: the bad-input battery and the edge cases on CUDA (the tables of msda.testing_cases that
tests/test_bad_input.py and tests/test_edge_cases.py run, not copies), tensors on a GPU other than
the current one, and a value tensor of more than 2**31 elements sampled near its end.

compute-sanitizer's memcheck over the same edge shapes: scripts/sanitize.py.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import msda
from msda.testing import DETR_LEVELS, Shape, reference, relative_error, tolerance
from msda.testing_cases import BAD_CALLS, EDGE_CASES, ENTRY_POINTS, EdgeCase, valid_args

from ..test_bad_input import assert_rejects, call, entry_points
from ..test_edge_cases import backend, check_case, edge_cases

# --- the battery ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,entry",
    [
        pytest.param(case, entry, id=f"{entry}-{case.id}")
        for case in BAD_CALLS
        if not case.needs_data
        for entry in entry_points(case)
    ],
)
def test_bad_call_raises_on_cuda(case, entry):
    """Every metadata check holds on CUDA; "other device" means CPU here. The checks run before
    the operator picks its path, so the Triton path (CUDA's default) stands for both."""
    with backend("triton"):
        assert_rejects(case, entry, valid_args("cuda"))


@pytest.mark.parametrize("case", [case for case in BAD_CALLS if case.needs_data], ids=lambda case: case.id)
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_unchecked_data_stays_in_bounds_on_cuda(case, path):
    """S != sum(H * W), empty or negative levels and inconsistent starts cannot be checked on
    CUDA without a host sync: there the call runs, every access masked inside `value`. It must
    not fault (a fault is sticky: synchronize() raises) and gives finite numbers."""
    args = case.edit(valid_args("cuda"))
    with backend(path):
        for entry in ENTRY_POINTS:
            results = call(entry, args)
            torch.cuda.synchronize()
            for result in results if isinstance(results, tuple) else (results,):
                assert torch.isfinite(result).all(), f"{entry}: non-finite result"


# --- the edge cases ---------------------------------------------------------------------------

# Edge cases too large for the interpreter: DETR levels, many queries, wide heads.
GPU_EDGE_CASES = [
    EdgeCase(
        "decoder-all-at-once",
        Shape(2, 300, 8, 32, DETR_LEVELS, 4),
        outside_fraction=0.2,
        special="nonfinite",
        views=True,
        expanded_grad=True,
        index_dtype=torch.int32,
    ),
    EdgeCase("16-heads-dim-256-far", Shape(1, 100, 16, 256, ((25, 42), (13, 21)), 4), 0.2, special="far"),
    EdgeCase("wide-tall-1x1-dim-96", Shape(2, 500, 8, 96, ((1, 512), (512, 1), (1, 1)), 4), outside_fraction=0.3),
    EdgeCase("dim-48-edges", Shape(2, 200, 4, 48, ((7, 9), (1, 1), (3, 1)), 3), special="edges"),
    EdgeCase("empty-batch-detr", Shape(0, 300, 8, 32, DETR_LEVELS, 4)),
    EdgeCase("empty-queries-detr", Shape(2, 0, 8, 32, DETR_LEVELS, 4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("case", EDGE_CASES + GPU_EDGE_CASES, ids=lambda case: case.id)
def test_edge_case_matches_reference_on_cuda(case, path, dtype):
    with backend(path):
        check_case(case, dtype, "cuda")


@given(case=edge_cases(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_fuzz_cuda(case, dtype, seed):
    with backend("triton"):
        check_case(case, dtype, "cuda", seed=seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(
    "case", [c for c in EDGE_CASES if c.id in ("1x1-levels", "non-finite", "all-at-once")], ids=lambda c: c.id
)
def test_tensors_on_a_gpu_other_than_the_current_one(case, path):
    """docs/contract.md: a CUDA tensor on any device index works, not only on cuda:0. The current device
    stays cuda:0 while every tensor lives on cuda:1 (and the other way round)."""
    with backend(path):
        for current, data in ((0, "cuda:1"), (1, "cuda:0")):
            with torch.cuda.device(current):
                check_case(case, torch.float32, data)
                torch.cuda.synchronize(data)


# --- a value tensor of more than 2**31 elements -------------------------------------------------

LARGE_B, LARGE_M, LARGE_D, LARGE_Q, LARGE_K = 2, 2, 32, 64, 4
LARGE_LEVELS = ((2048, 8192), (37, 53))  # H0 a power of two: see the oracle's cut below
CUT_ROWS = 2  # image rows of level 0 that the samples reach


def _large_locations(gen: torch.Generator) -> torch.Tensor:
    """(B, Q, M, 2, K, 2) float32 locations near the end of each batch entry: on level 0 within
    its last CUT_ROWS image rows (y_im in [H0 - 2 + 0.01, H0 + 0.3), x anywhere and a little
    outside); on level 1 around its far corner (x, y in [0.8, 1.1))."""
    (H0, _), _ = LARGE_LEVELS
    u = torch.rand(LARGE_B, LARGE_Q, LARGE_M, 2, LARGE_K, 2, dtype=torch.float64, generator=gen)
    level0_x = -0.05 + 1.1 * u[:, :, :, 0, :, 0]
    level0_y = (H0 - CUT_ROWS + 0.01 + 2.29 * u[:, :, :, 0, :, 1] + 0.5) / H0
    level0 = torch.stack((level0_x, level0_y), dim=-1)
    level1 = 0.8 + 0.3 * u[:, :, :, 1]
    return torch.stack((level0, level1), dim=3).to(torch.float32)


def _gpu_memory() -> int:
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpu_memory() < 24 * 2**30, reason="needs a GPU of 24 GiB")
def test_value_beyond_2_31_elements_sampled_near_its_end():
    """A bfloat16 value (2, S, 2, 32) with S = 2048 * 8192 + 37 * 53: 2**31 + 251,008 elements
    (4 GiB, and as much again for grad_value). Samples near the end of both batch entries put
    the gathered and scattered offsets of batch 1 past 2**31: 32-bit flat indices would wrap and
    read or write the wrong rows (or fault)."""
    (H0, W0), (H1, W1) = LARGE_LEVELS
    S = H0 * W0 + H1 * W1
    gen = torch.Generator().manual_seed(0)
    cuda_gen = torch.Generator("cuda").manual_seed(0)
    value = torch.randn(LARGE_B, S, LARGE_M, LARGE_D, dtype=torch.bfloat16, device="cuda", generator=cuda_gen)
    assert value.numel() > 2**31
    shapes = torch.tensor(LARGE_LEVELS, device="cuda")
    starts = msda.level_start_index_from_shapes(shapes)
    loc = _large_locations(gen).cuda()
    logits = torch.randn(LARGE_B, LARGE_Q, LARGE_M, 2 * LARGE_K, generator=gen)
    attn = logits.softmax(-1).view(LARGE_B, LARGE_Q, LARGE_M, 2, LARGE_K).cuda()
    grad_output = torch.randn(LARGE_B, LARGE_Q, LARGE_M * LARGE_D, generator=gen).to("cuda", torch.bfloat16)

    value.requires_grad_()
    loc.requires_grad_()
    attn.requires_grad_()
    out = msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    out.backward(grad_output)

    # The oracle on the rows the samples can reach, not on 4 GiB in float64. The last CUT_ROWS
    # image rows of level 0 followed by all of level 1 are the last R rows of each batch entry,
    # and form a valid two-level input of shapes (CUT_ROWS, W0), (H1, W1) on their own. A level-0
    # sample at y maps to y' = (y * H0 - (H0 - CUT_ROWS)) / CUT_ROWS in the cut level, which puts
    # it on the same pixels with the same bilinear weights (exact in float64, H0 and CUT_ROWS
    # being powers of two); no sample's corners reach above image row H0 - CUT_ROWS, so the cut
    # drops no contribution. The map is differentiable: gradients reach the original locations.
    R = CUT_ROWS * W0 + H1 * W1
    tail = value.detach()[:, S - R :].to(torch.float64).requires_grad_()
    loc64 = loc.detach().to(torch.float64).requires_grad_()
    attn64 = attn.detach().to(torch.float64).requires_grad_()
    y_cut = (loc64[:, :, :, 0, :, 1] * H0 - (H0 - CUT_ROWS)) / CUT_ROWS
    level0_cut = torch.stack((loc64[:, :, :, 0, :, 0], y_cut), dim=-1)
    loc_cut = torch.stack((level0_cut, loc64[:, :, :, 1]), dim=3)
    cut_shapes = torch.tensor([(CUT_ROWS, W0), (H1, W1)])
    expected = reference(tail, cut_shapes, loc_cut, attn64)
    expected.backward(grad_output.to(torch.float64))

    bound = tolerance(torch.bfloat16, torch.float32)
    errors = {
        "output": relative_error(out, expected),
        "grad_value (last R rows)": relative_error(value.grad[:, S - R :], tail.grad),
        "grad_sampling_locations": relative_error(loc.grad, loc64.grad),
        "grad_attention_weights": relative_error(attn.grad, attn64.grad),
    }
    assert all(e <= bound for e in errors.values()), f"relative errors {errors} exceed {bound:.1e}"
    # Nothing was scattered anywhere else (a wrapped 32-bit offset would land there).
    assert torch.count_nonzero(value.grad[:, : S - R]) == 0
