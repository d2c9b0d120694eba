"""msda.onnx: torch.onnx.export(dynamo=True) of models on msda's operator, run in onnxruntime.

The default translation (standard ONNX operators, GridSample per level) is checked end to end:
exported at one batch, query count and image size, run on CPU in onnxruntime at others, against
PyTorch within the contract's float32 bound (docs/contract.md). The plugin forms (one custom node
for mmdeploy's or NVIDIA's TensorRT plugin) are checked on the graph, as no plugin runs here.
"""

import math

import pytest
import torch
from torch.export import Dim

pytest.importorskip("onnxscript")  # guards only: the test extra installs onnx, onnxscript
ort = pytest.importorskip("onnxruntime")  # and onnxruntime
import onnx  # noqa: E402

import msda  # noqa: E402
import msda.onnx  # noqa: E402
from msda.testing import TOLERANCE, Shape, make_inputs, reference, reference_softmax, relative_error  # noqa: E402

from . import detr_block  # noqa: E402

pytestmark = pytest.mark.compile

SCATTERS = {"Scatter", "ScatterND", "ScatterElements"}


def run_onnx(path, args) -> list[torch.Tensor]:
    """The ONNX model at `path` run by onnxruntime on CPU, on `args` (its inputs, in order)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    assert len(inputs) == len(args), [i.name for i in inputs]
    outputs = session.run(None, {i.name: a.detach().numpy() for i, a in zip(inputs, args)})
    return [torch.from_numpy(o) for o in outputs]


def dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def shapes_by_name(model: onnx.ModelProto) -> dict[str, list]:
    infos = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    return {info.name: dims(info) for info in infos}


# The layer: a Deformable DETR decoder block on msda.MultiScaleDeformableAttention.


@pytest.fixture(scope="module")
def block():
    return detr_block.make_block().eval()


def export_block(block, path, plugin=None) -> onnx.ModelProto:
    """msda.onnx.export of the block at batch 3, 50 queries, a 320x256 image (tests/detr_block.py),
    with batch, queries and image size (the token count) dynamic."""
    example = detr_block.make_inputs(3, detr_block.IMAGE_SIZES[0], 50)
    msda.onnx.export(block, example, path, dynamic_shapes=detr_block.dynamic_shapes(), plugin=plugin)
    return onnx.load(path)


def test_layer_exports_to_standard_onnx_that_onnxruntime_runs_at_other_sizes(block, tmp_path):
    path = tmp_path / "block.onnx"
    model = export_block(block, path)

    # Standard operators only: one GridSample per level, read from the graph's level shapes, and
    # the layer's softmax (msda::forward_softmax) one Softmax.
    assert {node.domain for node in model.graph.node} == {""}
    assert [op.domain for op in model.opset_import] == [""]
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("GridSample") == detr_block.LEVELS
    assert ops.count("Softmax") == 1
    assert not SCATTERS & set(ops)
    inputs = {info.name: dims(info) for info in model.graph.input}
    assert inputs["query"] == ["batch", "queries", detr_block.D_MODEL]
    assert inputs["memory"] == ["batch", "tokens", detr_block.D_MODEL]
    assert inputs["spatial_shapes"] == [detr_block.LEVELS, 2]

    # Other batch sizes (1 included), query counts and image sizes than the export's.
    for seed, (batch, image_size, queries) in enumerate([(5, detr_block.IMAGE_SIZES[1], 70), (1, (200, 344), 7)]):
        args = detr_block.make_inputs(batch, image_size, queries, seed=seed)
        with torch.no_grad():
            expected = block(*args)
        (actual,) = run_onnx(path, args)
        error = relative_error(actual, expected)
        # Measured: 2e-7 (float32 rounding of GridSample against the operator's float64 positions).
        assert error <= TOLERANCE[torch.float32], (batch, image_size, queries, error)


# The operator alone, through plain torch.onnx.export with msda's translation table.


class Attention(torch.nn.Module):
    """msda.multi_scale_deformable_attention (with softmax=True, its softmax form on logits);
    with_starts=False passes None (starts computed in the graph from the shapes)."""

    def __init__(self, with_starts=True, softmax=False):
        super().__init__()
        self.with_starts = with_starts
        self.softmax = softmax

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        starts = level_start_index if self.with_starts else None
        fn = msda.multi_scale_deformable_attention_softmax if self.softmax else msda.multi_scale_deformable_attention
        return fn(value, spatial_shapes, starts, sampling_locations, attention_weights)


def with_non_finite_locations(loc: torch.Tensor) -> torch.Tensor:
    flat = loc.detach().clone().view(-1)
    for start, step, x in ((0, 7, math.nan), (1, 11, math.inf), (2, 13, -math.inf), (3, 17, 1e30), (4, 19, -1e30)):
        flat[start::step] = x
    return flat.view(loc.shape)


@pytest.mark.parametrize(
    "dtype, loc_dtype, shapes_dtype, with_starts, opset, softmax",
    [
        # The lowest opset with GridSample: the exporter writes opset 18, then converts.
        (torch.float32, torch.float32, torch.int64, True, 16, False),
        # float16 value with float32 locations (the translation computes in float32), int32
        # level shapes, level starts computed in the graph (the exporter's default opset, 20:
        # onnx's conversion to 16 or 17 breaks the ReduceProd of level_start_index_from_shapes).
        (torch.float16, torch.float32, torch.int32, False, None, False),
        # msda::forward_softmax: a Softmax of the logits, then the same.
        (torch.float32, torch.float32, torch.int64, True, 16, True),
        (torch.float16, torch.float32, torch.int32, False, None, True),
    ],
)
def test_translation_table_in_torch_onnx_export(tmp_path, dtype, loc_dtype, shapes_dtype, with_starts, opset, softmax):
    def inputs(shape, seed, **kwargs):
        args = list(make_inputs(shape, dtype, loc_dtype=loc_dtype, seed=seed, logits=softmax, **kwargs).args())
        args[1], args[2] = args[1].to(shapes_dtype), args[2].to(shapes_dtype)
        return args

    batch, queries, tokens = Dim("batch", min=1), Dim("queries", min=1), Dim("tokens", min=1)
    path = tmp_path / "attention.onnx"
    torch.onnx.export(
        Attention(with_starts, softmax).eval(),
        tuple(inputs(Shape(2, 5, 2, 4, ((6, 5), (3, 3)), 3), seed=0)),
        path,
        dynamo=True,
        dynamic_shapes=({0: batch, 1: tokens}, None, None, {0: batch, 1: queries}, {0: batch, 1: queries}),
        custom_translation_table=msda.onnx.translation_table(),
        opset_version=opset,
    )
    model = onnx.load(path)
    assert model.opset_import[0].version == (opset or 20)
    assert [node.op_type for node in model.graph.node].count("GridSample") == 2
    assert [node.op_type for node in model.graph.node].count("Softmax") == int(softmax)

    # Other batch, queries and level sizes; locations outside the levels, NaN, inf and huge;
    # -inf logits (weight 0).
    args = inputs(Shape(3, 7, 2, 4, ((9, 4), (2, 7)), 3), seed=1, outside_fraction=0.1)
    args[3] = with_non_finite_locations(args[3])
    if softmax:
        args[4].view(-1)[::5] = -math.inf
    else:  # non-finite weights on samples inside their level: their (batch, query, head) NaN
        inside = ((args[3] > 0.1) & (args[3] < 0.9)).all(-1).view(-1).nonzero().view(-1)
        for index, x in zip(inside[[0, 20, 40]].tolist(), (math.inf, -math.inf, math.nan)):
            args[4].view(-1)[index] = x
    (actual,) = run_onnx(path, args)
    assert actual.dtype == dtype
    weights = args[4] if softmax else torch.where(torch.isfinite(args[4]), args[4], 0.0)
    expected = (reference_softmax if softmax else reference)(args[0], args[1], args[3], weights)
    B, Q, M, D = expected.shape[0], expected.shape[1], args[0].shape[2], args[0].shape[3]
    heads = (~torch.isfinite(args[4])).flatten(3).any(-1) if not softmax else torch.zeros(B, Q, M, dtype=torch.bool)
    nan = heads.unsqueeze(-1).expand(B, Q, M, D).reshape(B, Q, M * D)
    assert torch.equal(torch.isnan(actual), nan) and nan.any() != softmax
    assert relative_error(actual[~nan], expected[~nan]) <= TOLERANCE[dtype]


# The plugin forms.


@pytest.mark.parametrize("plugin", msda.onnx.PLUGINS)
def test_plugin_form_is_one_node_of_the_plugins_signature(block, tmp_path, plugin):
    model = export_block(block, tmp_path / f"block-{plugin}.onnx", plugin=plugin)
    onnx.checker.check_model(model)
    domain, op_type = {
        "mmdeploy": (msda.onnx.MMDEPLOY_DOMAIN, msda.onnx.MMDEPLOY_OP),
        "nvidia": (msda.onnx.NVIDIA_DOMAIN, msda.onnx.NVIDIA_OP),
    }[plugin]
    assert domain in {op.domain for op in model.opset_import}
    custom = [node for node in model.graph.node if node.domain]
    assert [(node.domain, node.op_type) for node in custom] == [(domain, op_type)]
    (node,) = custom
    ops = {n.op_type for n in model.graph.node}
    assert "GridSample" not in ops and not SCATTERS & ops

    # value, spatial_shapes, level_start_index, sampling_locations, attention_weights; the level
    # shapes as int32 by a Cast of the int64 graph inputs; the weights the layer's logits after a
    # Softmax (msda::forward_softmax), reshaped to (B, Q, M, L, K).
    assert len(node.input) == 5
    producers = {output: n for n in model.graph.node for output in n.output}
    weights = producers[node.input[4]]
    while weights.op_type in ("Reshape", "Cast"):
        weights = producers[weights.input[0]]
    assert weights.op_type == "Softmax"
    for position, graph_input in ((1, "spatial_shapes"), (2, "level_start_index")):
        cast = producers[node.input[position]]
        assert cast.op_type == "Cast" and list(cast.input) == [graph_input]
        assert onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.INT32
    shapes = shapes_by_name(model)
    M, L, K = detr_block.HEADS, detr_block.LEVELS, detr_block.POINTS
    D = detr_block.D_MODEL // M
    assert shapes[node.input[0]] == ["batch", "tokens", M, D]
    assert shapes[node.input[3]] == ["batch", "queries", M, L, K, 2]
    assert shapes[node.input[4]] == ["batch", "queries", M, L, K]

    (output,) = node.output
    if plugin == "mmdeploy":
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes == {"im2col_step": 64}
        assert shapes[output] == ["batch", "queries", M * D]  # 3-D, as the plugin's
    else:
        # The plugin's output is (B, Q, M, D): a Reshape makes it the operator's (B, Q, M * D).
        assert not node.attribute
        (reshape,) = [n for n in model.graph.node if output in n.input]
        assert reshape.op_type == "Reshape"
        assert shapes[reshape.output[0]] == ["batch", "queries", M * D]


# Hugging Face transformers' Deformable DETR, patched to msda.


@pytest.mark.transformers
class TestTransformersDeformableDetr:
    @pytest.fixture(scope="class")
    def model(self):
        pytest.importorskip("transformers")
        from csrc_free_ops import transformers as hf_patch

        from msda.testing_cases import tiny_deformable_detr

        detr = tiny_deformable_detr().eval()
        assert hf_patch.patch(detr) == 2
        return Outputs(detr).eval()

    def test_exports_with_dynamic_batch(self, model, tmp_path):
        from msda.testing_cases import pixel_values

        # A 96x96 image: levels of 12x12 to 2x2 (a 1x1 level fails transformers' GroupNorm at batch 1).
        path, size = tmp_path / "deformable_detr.onnx", 96
        dynamic_shapes = {"pixel_values": {0: Dim("batch", min=1, max=64)}}
        msda.onnx.export(model, (pixel_values(2, size),), path, dynamic_shapes=dynamic_shapes)
        ops = [node.op_type for node in onnx.load(path).graph.node]
        assert ops.count("GridSample") == 2 * 4  # one encoder and one decoder layer, 4 levels
        for batch in (1, 3):
            pixels = pixel_values(batch, size, seed=batch)
            with torch.no_grad():
                expected = model(pixels)
            actual = run_onnx(path, [pixels])
            for name, a, e in zip(("last_hidden_state", "encoder_last_hidden_state"), actual, expected):
                assert relative_error(a, e) <= TOLERANCE[torch.float32], (batch, name)

    def test_dynamic_image_size_is_refused_not_fixed(self, model, tmp_path):
        """transformers' DeformableDetrModel.forward builds spatial_shapes with
        torch.as_tensor(spatial_shapes_list) and its encoder's get_reference_points calls
        torch.linspace(0.5, height - 0.5, height): both fix the level sizes, hence the image size
        (docs/deploy.md). torch.onnx.export would export for the example's size only; msda.onnx.export
        raises. When this test fails, transformers has changed: update docs/deploy.md."""
        from msda.testing_cases import pixel_values

        size = {2: Dim("height", min=65, max=1024), 3: Dim("width", min=65, max=1024)}
        with pytest.raises(torch._dynamo.exc.UserError, match=r"Constraints violated \(height, width\)"):
            msda.onnx.export(model, (pixel_values(2, 128),), tmp_path / "x.onnx", dynamic_shapes={"pixel_values": size})


class Outputs(torch.nn.Module):
    """A transformers model's two hidden states as a tuple (the exporter's outputs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state, out.encoder_last_hidden_state


# Arguments.


def test_unknown_plugin_and_dynamo_false_raise():
    with pytest.raises(ValueError, match="plugin must be None or one of 'mmdeploy', 'nvidia'"):
        msda.onnx.translation_table("tensorrt")
    with pytest.raises(ValueError, match="dynamo=True"):
        msda.onnx.export(Attention(), (), dynamo=False)
