"""csrc_free_ops.transformers.patch: transformers models on msda give what the stock models give."""

import copy
import importlib

import pytest
import torch

import msda
from csrc_free_ops import transformers as hf_patch
from msda.testing import Shape, make_inputs, relative_error
from msda.testing_cases import OUTPUTS, flat, outputs_and_grads, pixel_values, tiny_deformable_detr, training_loss

pytest.importorskip("transformers")  # a guard only: the test dependency group installs transformers

pytestmark = pytest.mark.transformers

# float32 end to end: the two paths differ by float32 rounding only.
FLOAT32_MODEL_TOLERANCE = 1e-5
MSDA_LAYER_PARAMETERS = ("sampling_offsets", "attention_weights", "value_proj", "output_proj")

# Model files that define a `MultiScaleDeformableAttention` kernel layer (those missing from the
# installed transformers are skipped).
MODEL_FILES = ["deformable_detr", "grounding_dino", "mm_grounding_dino", "rt_detr", "omdet_turbo", "lw_detr", "rf_detr"]


def test_patched_deformable_detr_matches_stock_outputs_and_gradients():
    stock = tiny_deformable_detr().train()
    patched = copy.deepcopy(stock)
    assert hf_patch.patch(patched) == 2  # one encoder layer, one decoder layer

    pixels = pixel_values()
    stock_out, stock_grads = outputs_and_grads(stock, pixels)
    patched_out, patched_grads = outputs_and_grads(patched, pixels)

    for key in OUTPUTS:
        assert relative_error(patched_out[key], stock_out[key]) <= FLOAT32_MODEL_TOLERANCE, key
    assert patched_grads.keys() == stock_grads.keys()
    assert relative_error(flat(patched_grads), flat(stock_grads)) <= FLOAT32_MODEL_TOLERANCE
    # Parameter by parameter for the deformable attention layers (two layers, four linears each).
    errors = {
        name: relative_error(patched_grads[name], grad)
        for name, grad in stock_grads.items()
        if any(f".{linear}." in name for linear in MSDA_LAYER_PARAMETERS)
    }
    assert len(errors) == 16 and max(errors.values()) <= FLOAT32_MODEL_TOLERANCE, errors


@pytest.mark.compile
def test_patched_training_step_traces_fullgraph():
    # Eval mode: in training mode upstream's encoder layer branches on tensor data (an overflow
    # guard), which fullgraph=True refuses for the stock model too. The eager backend: Dynamo's
    # capture without graph breaks is what is checked here; the GPU tier compiles with inductor.
    torch._dynamo.reset()
    model = tiny_deformable_detr().eval()
    hf_patch.patch(model)
    pixels = pixel_values()
    _, eager_grads = outputs_and_grads(model, pixels)
    model.zero_grad()

    loss, _ = torch.compile(training_loss, fullgraph=True, backend="eager")(model, pixels)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert relative_error(flat(grads), flat(eager_grads)) <= FLOAT32_MODEL_TOLERANCE


def test_patch_swaps_layers_only():
    model = tiny_deformable_detr()
    keys_before = model.state_dict().keys()
    hf_patch.patch(model)
    layers = [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"]
    assert layers and all(isinstance(m, hf_patch.MultiScaleDeformableAttention) for m in layers)
    assert model.state_dict().keys() == keys_before


def test_patch_raises_when_nothing_matches_unless_not_strict():
    model = tiny_deformable_detr()
    hf_patch.patch(model)
    with pytest.raises(ValueError, match="already patched"):
        hf_patch.patch(model)
    assert hf_patch.patch(model, strict=False) == 0
    with pytest.raises(ValueError, match="no transformers MultiScaleDeformableAttention"):
        hf_patch.patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("model_file", MODEL_FILES)
def test_patch_matches_each_models_kernel_layer(model_file):
    try:
        modeling = importlib.import_module(f"transformers.models.{model_file}.modeling_{model_file}")
    except ImportError:
        pytest.skip(f"transformers {model_file} is not installed")
    stock_layer = getattr(modeling, "MultiScaleDeformableAttention", None)
    if stock_layer is None:
        pytest.skip(f"this transformers' {model_file} has no MultiScaleDeformableAttention layer")
    holder = torch.nn.ModuleDict({"attn": stock_layer()})
    assert hf_patch.patch(holder) == 1

    inputs = make_inputs(Shape(batch=2, queries=7, heads=2, head_dim=4, levels=((6, 5), (3, 3)), points=3))
    shapes_list = [tuple(hw) for hw in inputs.spatial_shapes.tolist()]
    args = (inputs.value, inputs.spatial_shapes, shapes_list, inputs.level_start_index)
    args += (inputs.sampling_locations, inputs.attention_weights, 64)
    assert relative_error(holder["attn"](*args), stock_layer()(*args)) <= 1e-6


def test_layer_loads_transformers_multiscale_deformable_attention_state_dict():
    """transformers' DeformableDetrMultiscaleDeformableAttention is an upstream MSDeformAttn
    (same parameter names and shapes): its state_dict loads into msda's layer, same outputs."""
    from transformers import DeformableDetrConfig, ResNetConfig
    from transformers.models.deformable_detr.modeling_deformable_detr import (
        DeformableDetrMultiscaleDeformableAttention,
    )

    d_model, levels, heads, points = 32, 2, 4, 3
    # An explicit backbone config: without one, some transformers releases (5.17) fetch the
    # default backbone's config from the hub, and the GPU machine has no network.
    backbone = ResNetConfig(out_features=["stage3", "stage4"])
    config = DeformableDetrConfig(
        backbone_config=backbone, d_model=d_model, num_feature_levels=levels, use_timm_backbone=False,
        use_pretrained_backbone=False,
    )
    torch.manual_seed(0)
    upstream = DeformableDetrMultiscaleDeformableAttention(config, num_heads=heads, n_points=points)
    for p in upstream.parameters():  # random weights: the default init makes offsets too regular
        torch.nn.init.normal_(p, std=0.3)
    layer = msda.MultiScaleDeformableAttention(d_model, levels, heads, points)
    layer.load_state_dict(upstream.state_dict())

    shapes_list = [(6, 8), (3, 4)]
    shapes = torch.tensor(shapes_list)
    starts = msda.level_start_index_from_shapes(shapes)
    N, Len_q, Len_in = 2, 5, sum(h * w for h, w in shapes_list)
    query = torch.randn(N, Len_q, d_model)
    flatten = torch.randn(N, Len_in, d_model)
    padding = torch.rand(N, Len_in) < 0.2
    for coords in (2, 4):
        ref = torch.rand(N, Len_q, levels, coords)
        expected, _ = upstream(
            hidden_states=query,
            attention_mask=~padding,  # transformers' mask marks valid positions
            encoder_hidden_states=flatten,
            reference_points=ref,
            spatial_shapes=shapes,
            spatial_shapes_list=shapes_list,
            level_start_index=starts,
        )
        actual = layer(query, ref, flatten, shapes, starts, padding)
        assert relative_error(actual, expected) <= 1e-5, coords
