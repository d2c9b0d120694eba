"""msda.MultiScaleDeformableAttention is Deformable DETR's MSDeformAttn: parameters, init, forward."""

import math
import re
import warnings

import pytest
import torch

import msda
from msda.testing import TOLERANCE, reference, relative_error

D_MODEL, LEVELS, HEADS, POINTS = 32, 2, 4, 3
LEVEL_SHAPES = [(6, 8), (3, 4)]

# MSDeformAttn(d_model, n_levels, n_heads, n_points)'s state_dict: names and shapes.
UPSTREAM_STATE_SHAPES = {
    "sampling_offsets.weight": (HEADS * LEVELS * POINTS * 2, D_MODEL),
    "sampling_offsets.bias": (HEADS * LEVELS * POINTS * 2,),
    "attention_weights.weight": (HEADS * LEVELS * POINTS, D_MODEL),
    "attention_weights.bias": (HEADS * LEVELS * POINTS,),
    "value_proj.weight": (D_MODEL, D_MODEL),
    "value_proj.bias": (D_MODEL,),
    "output_proj.weight": (D_MODEL, D_MODEL),
    "output_proj.bias": (D_MODEL,),
}


def _upstream_state_dict(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(shape, generator=gen) for name, shape in UPSTREAM_STATE_SHAPES.items()}


def _inputs(coords, batch=2, queries=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(LEVEL_SHAPES)
    length = sum(h * w for h, w in LEVEL_SHAPES)
    return dict(
        query=torch.randn(batch, queries, D_MODEL, generator=gen),
        reference_points=torch.rand(batch, queries, LEVELS, coords, generator=gen),
        input_flatten=torch.randn(batch, length, D_MODEL, generator=gen),
        input_spatial_shapes=shapes,
        input_level_start_index=msda.level_start_index_from_shapes(shapes),
        input_padding_mask=torch.rand(batch, length, generator=gen) < 0.2,
    )


def _reference_layer(state, query, reference_points, input_flatten, input_spatial_shapes, input_padding_mask, **_):
    """The layer from its definition in float64, sampling by msda.testing.reference."""

    def linear(x, name):
        return x.double() @ state[f"{name}.weight"].double().T + state[f"{name}.bias"].double()

    N, Q, _ = query.shape
    value = linear(input_flatten, "value_proj") * (~input_padding_mask[..., None])
    value = value.view(N, input_flatten.shape[1], HEADS, D_MODEL // HEADS)
    offsets = linear(query, "sampling_offsets").view(N, Q, HEADS, LEVELS, POINTS, 2)
    logits = linear(query, "attention_weights").view(N, Q, HEADS, LEVELS * POINTS)
    weights = logits.softmax(-1).view(N, Q, HEADS, LEVELS, POINTS)
    ref = reference_points.double()[:, :, None, :, None, :]
    if ref.shape[-1] == 2:
        pixels_per_unit = input_spatial_shapes.flip(-1).double()[None, None, None, :, None, :]  # (W, H)
        locations = ref + offsets / pixels_per_unit
    else:
        locations = ref[..., :2] + offsets * ref[..., 2:] / (2 * POINTS)
    return linear(reference(value, input_spatial_shapes, locations, weights), "output_proj")


def test_parameter_names_and_shapes_are_msdeformattns():
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    assert {name: tuple(t.shape) for name, t in layer.state_dict().items()} == UPSTREAM_STATE_SHAPES
    assert (layer.d_model, layer.n_levels, layer.n_heads, layer.n_points) == (D_MODEL, LEVELS, HEADS, POINTS)


def test_defaults_are_deformable_detrs():
    layer = msda.MultiScaleDeformableAttention()
    assert (layer.d_model, layer.n_levels, layer.n_heads, layer.n_points) == (256, 4, 8, 4)


@pytest.mark.parametrize("coords", [2, 4])
def test_upstream_state_dict_loads_and_matches_reference(coords):
    state = _upstream_state_dict()
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    layer.load_state_dict(state)  # strict: the same names and shapes
    inputs = _inputs(coords)

    out = layer(**inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad_out)

    ref_state = {name: t.double().requires_grad_() for name, t in state.items()}
    expected = _reference_layer(ref_state, **inputs)
    expected.backward(grad_out.double())

    bound = TOLERANCE[torch.float32]
    assert relative_error(out, expected) <= bound
    for name, p in layer.named_parameters():
        assert relative_error(p.grad, ref_state[name].grad) <= bound, name


def test_level_start_index_may_be_none():
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    inputs = _inputs(2)
    expected = layer(**inputs)
    assert torch.equal(layer(**{**inputs, "input_level_start_index": None}), expected)


def test_initialization():
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    # Four heads at 0, 90, 180, 270 degrees; point i at (i + 1) times the head's direction.
    directions = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    expected = directions.view(HEADS, 1, 1, 2) * torch.tensor([1.0, 2.0, 3.0]).view(1, 1, POINTS, 1)
    expected = expected.expand(HEADS, LEVELS, POINTS, 2).reshape(-1)
    torch.testing.assert_close(layer.sampling_offsets.bias.detach(), expected, atol=1e-6, rtol=0)
    assert not layer.sampling_offsets.weight.any()
    assert not layer.attention_weights.weight.any() and not layer.attention_weights.bias.any()
    for projection in (layer.value_proj, layer.output_proj):
        xavier_bound = math.sqrt(6 / (2 * D_MODEL))
        assert projection.weight.abs().max() <= xavier_bound and projection.weight.std() > xavier_bound / 3
        assert not projection.bias.any()


def test_diagonal_heads_are_scaled_to_the_unit_square():
    layer = msda.MultiScaleDeformableAttention(d_model=16, n_levels=1, n_heads=8, n_points=1)
    first_two = layer.sampling_offsets.bias.detach().view(8, 2)[:2]
    torch.testing.assert_close(first_two, torch.tensor([[1.0, 0.0], [1.0, 1.0]]), atol=1e-6, rtol=0)


def test_reset_parameters_restores_the_initialization():
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    bias = layer.sampling_offsets.bias.detach().clone()
    layer.load_state_dict(_upstream_state_dict())
    layer._reset_parameters()
    assert torch.equal(layer.sampling_offsets.bias.detach(), bias)


def test_d_model_not_divisible_by_n_heads_is_an_error():
    with pytest.raises(ValueError, match="d_model must be divisible by n_heads"):
        msda.MultiScaleDeformableAttention(d_model=30, n_heads=8)
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        msda.MultiScaleDeformableAttention(n_heads=0)


def test_head_dim_not_a_power_of_2_warns_only():
    with pytest.warns(UserWarning, match="power of 2"):
        layer = msda.MultiScaleDeformableAttention(d_model=48, n_levels=LEVELS, n_heads=8, n_points=POINTS)
    inputs = _inputs(2)
    inputs["query"] = torch.randn(2, 5, 48)
    inputs["input_flatten"] = torch.randn(2, inputs["input_flatten"].shape[1], 48)
    assert layer(**inputs).shape == (2, 5, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)


def test_reference_points_must_end_in_2_or_4():
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    inputs = _inputs(2)
    inputs["reference_points"] = torch.rand(2, 5, LEVELS, 3)
    with pytest.raises(ValueError, match="reference_points must end in 2"):
        layer(**inputs)


# The layer checks its own arguments as the operator does (issue 15, item 5): each case edits
# valid arguments into invalid ones; the error names the argument and what was expected.
def _bad(argument, what, change, error):
    """(id, edit, error, argument): `change` applied to `argument` of valid layer inputs."""
    return (f"{argument}-{what}", lambda args: {**args, argument: change(args[argument])}, error, argument)


def _one_more(dim):
    return lambda t: torch.cat([t, t.narrow(dim, 0, 1)], dim)


LAYER_BAD_CALLS = [
    _bad("query", "width", lambda t: t[..., :-1], ValueError),
    _bad("query", "2d", lambda t: t[0], ValueError),
    _bad("query", "list", lambda t: t.tolist(), TypeError),
    _bad("query", "int", lambda t: t.long(), TypeError),
    _bad("input_flatten", "width", _one_more(-1), ValueError),
    _bad("input_flatten", "batch", lambda t: t[:1], ValueError),
    _bad("input_flatten", "4d", lambda t: t[None], ValueError),
    _bad("input_flatten", "None", lambda t: None, TypeError),
    _bad("input_flatten", "device", lambda t: t.to("meta"), ValueError),
    _bad("reference_points", "one-level", lambda t: t[:, :, :1], ValueError),
    _bad("reference_points", "extra-level", _one_more(2), ValueError),
    _bad("reference_points", "3d", lambda t: t[:, :, 0], ValueError),
    _bad("reference_points", "xyz", lambda t: t[..., [0, 1, 1]], ValueError),
    _bad("reference_points", "batch", lambda t: t[:1], ValueError),
    _bad("reference_points", "queries", lambda t: t[:, :2], ValueError),
    _bad("reference_points", "int", lambda t: t.long(), TypeError),
    _bad("input_spatial_shapes", "levels", lambda t: t[:1], ValueError),
    _bad("input_spatial_shapes", "float", lambda t: t.float(), TypeError),
    _bad("input_spatial_shapes", "1d", lambda t: t.flatten(), ValueError),
    _bad("input_spatial_shapes", "Lx3", lambda t: t[:, [0, 1, 1]], ValueError),
    _bad("input_spatial_shapes", "list", lambda t: t.tolist(), TypeError),
    _bad("input_level_start_index", "levels", lambda t: t[:1], ValueError),
    _bad("input_level_start_index", "float", lambda t: t.float(), TypeError),
    _bad("input_padding_mask", "one-row", lambda t: t[0], ValueError),
    _bad("input_padding_mask", "batch", lambda t: t[:1], ValueError),
    _bad("input_padding_mask", "tokens", lambda t: t[:, 1:], ValueError),
    _bad("input_padding_mask", "3d", lambda t: t[..., None], ValueError),
    _bad("input_padding_mask", "float", lambda t: t.float(), TypeError),
    _bad("input_padding_mask", "uint8", lambda t: t.to(torch.uint8), TypeError),
    _bad("input_padding_mask", "device", lambda t: t.to("meta"), ValueError),
]


@pytest.mark.parametrize("edit,error,argument", [c[1:] for c in LAYER_BAD_CALLS], ids=[c[0] for c in LAYER_BAD_CALLS])
def test_layer_rejects_bad_arguments_naming_them(edit, error, argument):
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    args = edit(_inputs(2))
    with pytest.raises((TypeError, ValueError)) as info:
        layer(**args)
    message = str(info.value)
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {message}"
    assert re.search(rf"\b{argument}\b", message), message
    assert re.search(r"\b(must|expected)\b", message), message


def test_layer_token_count_against_the_levels_is_the_operators_error():
    """Len_in against sum(H_l * W_l) reads the shapes' data: the operator checks it (on CPU
    always, on CUDA under msda.validate())."""
    layer = msda.MultiScaleDeformableAttention(D_MODEL, LEVELS, HEADS, POINTS)
    args = _inputs(2)
    args["input_flatten"] = args["input_flatten"][:, :-1]
    args["input_padding_mask"] = args["input_padding_mask"][:, :-1]
    with pytest.raises(ValueError, match=r"value has S = 59 rows.*expected sum\(H_l \* W_l\) = 60"):
        layer(**args)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(n_heads=True), TypeError),
        (dict(n_points=2.0), TypeError),
        (dict(d_model="256"), TypeError),
        (dict(n_levels=None), TypeError),
        (dict(n_levels=-1), ValueError),
        (dict(n_points=0), ValueError),
    ],
    ids=["bool-heads", "float-points", "str-d_model", "None-levels", "negative-levels", "zero-points"],
)
def test_constructor_rejects_non_positive_ints(kwargs, error):
    (name,) = kwargs
    with pytest.raises(error, match=rf"{name} must be a positive int"):
        msda.MultiScaleDeformableAttention(**kwargs)
