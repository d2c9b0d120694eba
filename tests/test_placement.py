"""Sample placement at the float32 rounding borders: the cell a sample falls in must be the one of
an exact x * W - 0.5, since the location gradient jumps between cells. Locations are picked where
float32 arithmetic rounds x * W - 0.5 onto the other side of a pixel border (interior borders,
the left edge x_im = -1 and the right edge x_im = W), and both paths are compared with the float64
oracle, which computes x * W - 0.5 exactly for float32 x."""

from __future__ import annotations

import math
import os
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from msda import ops
from msda.testing import Inputs, Shape, make_inputs

from .helpers import assert_matches_reference, forward_backward, random_like_output

LEVELS = ((100, 167), (50, 84), (25, 42))
SHAPE = Shape(batch=1, queries=24, heads=2, head_dim=4, levels=LEVELS, points=2)


def rounding_border_coordinates(size: int, count: int, gen: np.random.Generator) -> np.ndarray:
    """float32 x where float32 rounding of x * size - 0.5 (a plain product or an fma) and the
    exact value floor to different cells."""
    found = []
    borders = np.arange(-1, size + 1) if size < 64 else np.concatenate([gen.integers(-1, size + 1, 64), [-1, size]])
    for border in borders:  # x_im = border: x = (border + 0.5) / size
        centre = np.float32((border + 0.5) / size)
        for direction in (np.float32(-np.inf), np.float32(np.inf)):
            x = centre
            for _ in range(40):
                x = np.nextafter(x, direction)
                exact = np.floor(np.float64(x) * size - 0.5)
                rounded = np.floor(np.float32(np.float32(x) * np.float32(size)) - np.float32(0.5))
                fused = np.floor(np.float32(np.float64(x) * size - 0.5))
                if rounded != exact or fused != exact:
                    found.append(x)
    assert len(found) >= count, f"only {len(found)} rounding borders found for size {size}"
    return np.array(found, dtype=np.float32)


def border_inputs(seed: int) -> Inputs:
    """The shape's inputs with every sample's x and y on a rounding border of its level."""
    inputs = make_inputs(SHAPE, torch.float32, seed=seed)
    gen = np.random.default_rng(seed)
    loc = inputs.sampling_locations.clone()
    per_level = loc[0, :, :, 0, :, 0].numel()
    for level, (h, w) in enumerate(LEVELS):
        for axis, size in ((0, w), (1, h)):
            picks = gen.choice(rounding_border_coordinates(size, 4, gen), per_level)
            loc[0, :, :, level, :, axis] = torch.from_numpy(picks).view(loc.shape[1], loc.shape[2], loc.shape[4])
    return Inputs(inputs.value, inputs.spatial_shapes, inputs.level_start_index, loc, inputs.attention_weights)


needs_interpreter = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not (ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"), reason="no interpreter"),
]


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cells_at_rounding_borders(monkeypatch, path, seed):
    monkeypatch.setattr(ops, "BACKEND", path)
    inputs = border_inputs(seed)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


def _float32(value: float) -> float:
    """`value` rounded to the nearest float32 (by struct, not numpy: independent of the picking)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def test_borders_are_found():
    """The picked coordinates do straddle cells under float32 rounding (the test above would
    pass vacuously otherwise), checked with exact rationals and struct's float32 rounding rather
    than the numpy arithmetic that picked them: for each x, a float32 product then a float32
    subtraction, or one rounding of the exact x * W - 0.5 (an fma), floors to another cell than
    the exact value does."""
    gen = np.random.default_rng(0)
    for size in (167, 100, 84, 50, 42, 25):
        x = rounding_border_coordinates(size, 4, gen)
        assert len(x) >= 4
        for v in map(float, x):
            exact = math.floor(Fraction(v) * size - Fraction(1, 2))
            product_then_subtraction = math.floor(_float32(_float32(v * size) - 0.5))
            fused = math.floor(_float32(float(Fraction(v) * size - Fraction(1, 2))))
            assert product_then_subtraction != exact or fused != exact, (size, v)


def test_float64_locations_just_under_a_pixel_centre_line():
    """float64 locations take the reference's cell too: x just under (n + 0.5) / W, so that x * W -
    0.5 is an integer n less one ulp and the cell is n - 1. The CPU path once shifted positions by
    + 1.5 after rounding x * W, which rounded onto n + 2 and took the next cell's location
    gradient (n = 0, 1, 2, 6, 14, ...: where n + 0.5 and n + 2 lie in different binades)."""
    gen = torch.Generator().manual_seed(41)
    for width in (1, 2, 4, 8, 16, 64):
        n = width // 2 if width > 2 else width - 1
        x = math.nextafter((n + 0.5) / width, 0.0)
        assert math.floor(Fraction(x) * width - Fraction(1, 2)) == n - 1
        value = torch.randn(1, 2 * width, 1, 4, generator=gen, dtype=torch.float64)
        shapes, starts = torch.tensor([[2, width]]), torch.tensor([0])
        loc = torch.tensor([x, 0.3], dtype=torch.float64).view(1, 1, 1, 1, 1, 2)
        attn = torch.ones(1, 1, 1, 1, 1, dtype=torch.float64)
        inputs = Inputs(value, shapes, starts, loc, attn)
        grad_output = torch.randn(1, 1, 4, generator=gen, dtype=torch.float64)
        assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)
