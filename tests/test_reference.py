"""The float64 oracle (msda.testing.reference) agrees with F.grid_sample, forward and gradients."""

import pytest
import torch
import torch.nn.functional as F

from msda.testing import Shape, make_inputs, reference

SHAPES = [
    Shape(batch=2, queries=5, heads=3, head_dim=4, levels=((6, 7), (3, 4), (1, 1)), points=3),
    Shape(batch=1, queries=9, heads=1, head_dim=2, levels=((1, 9), (8, 1)), points=2),
]


def grid_sample_msda(value, spatial_shapes, sampling_locations, attention_weights):
    """MSDA as model code writes it without an extension: one F.grid_sample per level."""
    B, S, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    sizes = [h * w for h, w in spatial_shapes.tolist()]
    grids = 2 * sampling_locations - 1  # grid_sample's [-1, 1] coordinates
    sampled = []
    for level, (value_l, (h, w)) in enumerate(zip(value.split(sizes, dim=1), spatial_shapes.tolist())):
        image = value_l.permute(0, 2, 3, 1).reshape(B * M, D, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).reshape(B * M, Q, K, 2)
        sampled.append(F.grid_sample(image, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    stacked = torch.stack(sampled, dim=-2).flatten(-2)  # (B*M, D, Q, L*K)
    weights = attention_weights.transpose(1, 2).reshape(B * M, 1, Q, L * K)
    return (stacked * weights).sum(-1).view(B, M * D, Q).transpose(1, 2)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("outside_fraction", [0.0, 0.3])
def test_reference_matches_grid_sample(shape, outside_fraction):
    inputs = make_inputs(shape, torch.float64, outside_fraction=outside_fraction, seed=7, requires_grad=True)
    args = (inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights)
    ours = reference(*args)
    theirs = grid_sample_msda(*args)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)

    grad = torch.randn_like(ours)
    wrt = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    for a, b in zip(torch.autograd.grad(ours, wrt, grad), torch.autograd.grad(theirs, wrt, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_reference_ignores_non_finite_locations():
    shape = SHAPES[0]
    inputs = make_inputs(shape, torch.float64, seed=8)
    loc = inputs.sampling_locations.clone()
    loc[0, 0, 0, 0, 0] = torch.tensor([float("nan"), 0.5])
    loc[0, 1, 0, 1, 0] = torch.tensor([float("inf"), -float("inf")])
    poisoned = reference(inputs.value, inputs.spatial_shapes, loc, inputs.attention_weights)
    attn = inputs.attention_weights.clone()
    attn[0, 0, 0, 0, 0] = attn[0, 1, 0, 1, 0] = 0  # the same samples, switched off instead
    clean = reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations, attn)
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)
