"""The CPU kernels of the pure-PyTorch path (msda/torch_impl.py: embedding_bag, the chunked
corner dot products, the sorted grad_value scatter): eager CPU calls take them, they match the
float64 oracle across chunk boundaries and batch entries, the device-generic path they replace on
CPU still matches too (it is what CUDA runs in deterministic mode, and MPS), and under
torch.compile the operator stays one node on CPU that runs them."""

from unittest import mock

import pytest
import torch

import msda
from msda import eager_cpu, ops, torch_impl
from msda.testing import Inputs, Shape, make_inputs, reference_with_grads, relative_error

from .helpers import assert_matches_reference, forward_backward, random_like_output

SHAPE = Shape(batch=3, queries=13, heads=2, head_dim=5, levels=((7, 9), (4, 5), (2, 3)), points=3)
DTYPE_CASES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
]


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setattr(ops, "BACKEND", "torch")


@pytest.mark.parametrize("dtype,loc_dtype", DTYPE_CASES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("corners_per_chunk", [1, 150, torch_impl.CORNERS_PER_CHUNK])
@pytest.mark.parametrize("grad_value_by", ["rows", "cells"])
def test_cpu_kernels_match_reference_across_chunks(dtype, loc_dtype, corners_per_chunk, grad_value_by, monkeypatch):
    """Chunks of one query row, of a few (straddling batch entries: 13 queries a batch entry,
    150 // (2 * 4 * 9) = 2 query rows a chunk), and the default (all at once); grad_value summed
    by each corner's row and by each sample's top-left cell, whatever the shape's density would
    pick."""
    monkeypatch.setattr(torch_impl, "CORNERS_PER_CHUNK", corners_per_chunk)
    monkeypatch.setattr(torch_impl, "CELL_SUMS_MIN_CORNERS_PER_CELL", 0 if grad_value_by == "cells" else 2**62)
    inputs = make_inputs(SHAPE, dtype, loc_dtype=loc_dtype, outside_fraction=0.2, seed=21)
    grad_output = random_like_output(inputs)
    with (
        mock.patch.object(torch_impl, "_cpu_forward", wraps=torch_impl._cpu_forward) as fwd,
        mock.patch.object(torch_impl, "_cpu_backward", wraps=torch_impl._cpu_backward) as bwd,
    ):
        results = forward_backward(inputs, grad_output)
    assert (fwd.call_count, bwd.call_count) == (1, 1)
    assert_matches_reference(inputs, results, grad_output)


@pytest.mark.parametrize("dist", ["uniform", "local"])
def test_generic_path_matches_reference_on_cpu(dist, monkeypatch):
    """The index_select / index_add_ path, run on CPU tensors as if they were another device's
    (whose calls the CPU fast path, msda/eager_cpu.py, does not take)."""
    monkeypatch.setattr(torch_impl, "_is_eager_cpu", lambda *tensors: False)
    monkeypatch.setattr(eager_cpu, "eligible", lambda *tensors: False)
    inputs = make_inputs(SHAPE, torch.float32, dist=dist, outside_fraction=0.2, seed=22)
    grad_output = random_like_output(inputs)
    with mock.patch.object(torch_impl, "_cpu_forward") as fwd, mock.patch.object(torch_impl, "_cpu_backward") as bwd:
        results = forward_backward(inputs, grad_output)
    assert fwd.call_count == bwd.call_count == 0
    assert_matches_reference(inputs, results, grad_output)


def test_chunks_of_one_bag(monkeypatch):
    """One head, a query row a chunk: each chunk's corners belong to one bag, whose expanded index
    of bags reshapes to a stride-0 view that ATen's dot kernel refuses (it needs it contiguous)."""
    monkeypatch.setattr(torch_impl, "CORNERS_PER_CHUNK", 1)
    shape = Shape(batch=2, queries=3, heads=1, head_dim=4, levels=((5, 4), (2, 3)), points=2)
    inputs = make_inputs(shape, torch.float32, outside_fraction=0.2, seed=27)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


def test_cpu_kernels_are_bitwise_reproducible_across_runs_and_thread_counts():
    """No atomics and a stable sort: the same bits every run, with 1 thread or 2 (the forward
    sums each bag in order, the grad_value scatter each row's corners in their sorted order).
    153,600 corners: every elementwise op is split between threads when there are two."""
    shape = Shape(batch=2, queries=300, heads=8, head_dim=32, levels=((20, 30), (10, 15)), points=4)
    inputs = make_inputs(shape, torch.float32, outside_fraction=0.2, seed=26)
    grad_output = random_like_output(inputs)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            results.append(forward_backward(inputs, grad_output))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_location_gradient_cell_choice_is_exact_at_detr_sizes():
    """Locations one float32 step below or above pixel centres of Deformable DETR's 800x1333
    levels, where x * W - 0.5 crosses an integer: the cell, hence the location gradient, which
    jumps there, is that of an exact computation, as the float64 oracle has it."""
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    shape = Shape(batch=1, queries=64, heads=2, head_dim=4, levels=levels, points=2)
    inputs = make_inputs(shape, torch.float32, seed=23)
    gen = torch.Generator().manual_seed(24)
    size = torch.tensor(levels, dtype=torch.float64).flip(1).view(1, 1, 1, -1, 1, 2)  # (W, H)
    pixel = torch.randint(0, 13, inputs.sampling_locations.shape, generator=gen).to(torch.float64)
    exact = (pixel + 0.5) / size  # x * W - 0.5 = pixel
    below = torch.rand(exact.shape, generator=gen) < 0.5
    loc = exact.to(torch.float32)
    loc = torch.where(below, torch.nextafter(loc, torch.zeros(())), torch.nextafter(loc, torch.ones(())))
    inputs.sampling_locations = loc
    grad_output = random_like_output(inputs)
    errors = assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)
    assert errors["grad_sampling_locations"] <= 1e-6


def test_level_tensors_cached_under_inference_mode_serve_later_autograd_calls():
    """The per-level tensors and constants are cached across calls (`_level_tensors`, `_constants`):
    made first inside torch.inference_mode() they are inference tensors, which a later call with
    gradients must still be able to read (never write, never save for backward)."""
    torch_impl._level_tensors.cache_clear()
    torch_impl._constants.cache_clear()
    inputs = make_inputs(SHAPE, torch.float32, outside_fraction=0.2, seed=23)
    grad_output = random_like_output(inputs)
    with torch.inference_mode():
        inference_out = msda.multi_scale_deformable_attention(*inputs.args())
    assert torch_impl._level_tensors.cache_info().currsize == 1
    results = forward_backward(inputs, grad_output)
    assert torch_impl._level_tensors.cache_info().hits >= 1
    assert torch.equal(results[0], inference_out)
    assert_matches_reference(inputs, results, grad_output)


def test_compiled_operator_runs_the_cpu_kernels():
    """torch.compile keeps torch.ops.msda.forward / backward whole on CPU (not traced into its
    body): at run time the compiled graph calls the CPU kernels, once per forward and backward."""
    torch._dynamo.reset()
    inputs = make_inputs(SHAPE, torch.float32, outside_fraction=0.2, seed=25)
    grad_output = random_like_output(inputs)
    compiled = torch.compile(msda.multi_scale_deformable_attention, fullgraph=True, dynamic=True, backend="aot_eager")
    forward_backward(inputs, grad_output, compiled)  # compiles
    with (
        mock.patch.object(torch_impl, "_cpu_forward", wraps=torch_impl._cpu_forward) as fwd,
        mock.patch.object(torch_impl, "_cpu_backward", wraps=torch_impl._cpu_backward) as bwd,
    ):
        results = forward_backward(inputs, grad_output, compiled)
    assert (fwd.call_count, bwd.call_count) == (1, 1)
    expected = reference_with_grads(inputs, grad_output)
    assert all(relative_error(got, want) <= 1e-5 for got, want in zip(results, expected))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_value_next_to_samples_outside_their_level(bad):
    """docs/contract.md: a corner outside its level contributes zero. The CPU kernels read such a
    corner's nearest inside row with weight 0, and 0 * inf is NaN: where a NaN comes out, the call
    is redone with each outside corner masked. Here inf or NaN sits on the level's corner pixels,
    samples lie wholly outside next to them, and the rest inside, away from them: output and
    gradients finite and the oracle's (also for the same value with those pixels 0, which no
    inside corner reads), through the functional form and the operator."""
    H, W = 4, 5
    gen = torch.Generator().manual_seed(51)
    value = torch.randn(1, H * W, 2, 3, generator=gen)
    value[0, [0, W - 1, (H - 1) * W, H * W - 1]] = bad  # the four corner pixels
    loc = torch.rand(1, 6, 2, 1, 2, 2, generator=gen) * 0.3 + 0.35  # inside, away from the edges
    loc[0, :3, :, 0, 0] = torch.tensor([[-1.0, 0.05], [1.5, 0.95], [0.02, -0.9]])[:, None]  # wholly outside
    inputs = Inputs(value, torch.tensor([[H, W]]), torch.tensor([0]), loc,
                    torch.rand(1, 6, 2, 1, 2, generator=gen))  # fmt: skip
    grad_output = random_like_output(inputs)
    clean = Inputs(torch.nan_to_num(value, nan=0.0, posinf=0.0), *inputs.args()[1:])
    for fn in (msda.multi_scale_deformable_attention, torch.ops.msda.forward):
        results = forward_backward(inputs, grad_output, fn)
        assert all(bool(torch.isfinite(t).all()) for t in results)
        assert_matches_reference(inputs, results, grad_output)
        assert_matches_reference(clean, results, grad_output)
