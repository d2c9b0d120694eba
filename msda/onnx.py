"""ONNX export of models that call msda's operators (`torch.ops.msda.forward`, and
`torch.ops.msda.forward_softmax`, which msda.MultiScaleDeformableAttention calls).

    import msda.onnx

    onnx_program = msda.onnx.export(model, args, "model.onnx", dynamic_shapes=...)

`export` is `torch.onnx.export(..., dynamo=True)` with msda's translation of the operator in its
`custom_translation_table`; `translation_table()` is that table, for a direct call of
`torch.onnx.export`. The default translation writes the operator in standard ONNX operators, one
`GridSample` per feature level, with the level sizes read from the `spatial_shapes` input at run
time: onnxruntime runs the model, TensorRT parses it with no plugin, at any batch and image size.
`plugin="mmdeploy"` or `plugin="nvidia"` writes instead one custom-domain node for that TensorRT
plugin. The softmax operator is the same after a standard `Softmax` over each head's L * K
logits (before the plugin node too: neither plugin normalizes). docs/deploy.md has the details.

This module needs `onnx` and `onnxscript` (as `torch.onnx.export(dynamo=True)` does); `import
msda` does not import it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import onnx
import torch
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset
from torch.export import Dim

__all__ = ["PLUGINS", "export", "translation_table"]

PLUGINS = ("mmdeploy", "nvidia")
# mmdeploy's TensorRT plugin (libmmdeploy_tensorrt_ops.so): the node its symbolic for mmcv's
# MultiScaleDeformableAttnFunction writes, with the attribute value it writes (the plugin ignores it).
MMDEPLOY_DOMAIN, MMDEPLOY_OP, MMDEPLOY_IM2COL_STEP = "mmdeploy", "MMCVMultiScaleDeformableAttention", 64
# NVIDIA's TensorRT OSS plugin (libnvinfer_plugin.so). TensorRT's ONNX parser finds a plugin by
# op type alone, so the domain is a label.
NVIDIA_DOMAIN, NVIDIA_OP = "trt", "MultiscaleDeformableAttnPlugin_TRT"

# A grid coordinate (2 * location - 1) of magnitude 2 or more samples nothing: its bilinear
# corners all lie outside a level of any size. Non-finite and huge coordinates (NaN fails the
# comparison) are replaced by this one, also outside, before GridSample turns them into indices.
_OUTSIDE = 3.0


def _static(value: ir.Value, dim: int, name: str, what: str) -> int:
    size = value.shape[dim] if value.shape is not None else None
    if not isinstance(size, int):
        raise ValueError(
            f"msda's ONNX translation needs a static {what} (dim {dim} of {name}), got {size!r}: "
            "make only batch, queries and the token count dynamic"
        )
    return size


def _ints(*values: int) -> ir.Value:
    return op.Constant(value_ints=list(values))


def _cast(x: ir.Value, dtype: ir.DataType) -> ir.Value:
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """`msda::forward` in standard ONNX operators, one `GridSample` per feature level.

    The level sizes H_l, W_l and start rows are read from the `spatial_shapes` and
    `level_start_index` tensors at run time (the image size stays dynamic); the level count,
    heads, head dim and points are static. Computes in float32 (float64 for float64 inputs), as
    the operator does, and returns `value`'s dtype.
    """
    M = _static(value, 2, "value", "head count M")
    D = _static(value, 3, "value", "head dim D")
    L = _static(sampling_locations, 3, "sampling_locations", "level count L")
    K = _static(sampling_locations, 4, "sampling_locations", "point count K")
    inputs = (value, sampling_locations, attention_weights)
    ctype = ir.DataType.DOUBLE if any(t.dtype == ir.DataType.DOUBLE for t in inputs) else ir.DataType.FLOAT

    batch = op.Shape(value, start=0, end=1)  # [B]
    queries = op.Shape(sampling_locations, start=1, end=2)  # [Q]
    batch_heads = op.Mul(batch, _ints(M))  # [B * M]
    shapes = _cast(spatial_shapes, ir.DataType.INT64)  # (L, 2)
    starts = _cast(level_start_index, ir.DataType.INT64)  # (L,)
    areas = op.Mul(op.Gather(shapes, _ints(0), axis=1), op.Gather(shapes, _ints(1), axis=1))  # (L, 1)
    ends = op.Add(starts, op.Reshape(areas, _ints(-1)))  # (L,)

    # (B, S, M, D) -> (B, M, D, S): each level a slice of the last axis.
    channels_first = op.Transpose(_cast(value, ctype), perm=[0, 2, 3, 1])

    # GridSample's [-1, 1] grid (align_corners=0 is the operator's x * W - 0.5 convention).
    loc = _cast(sampling_locations, ctype)
    grid = op.Sub(op.Add(loc, loc), op.CastLike(op.Constant(value_float=1.0), loc))
    outside = op.CastLike(op.Constant(value_float=_OUTSIDE), loc)
    grid = op.Where(op.Less(op.Abs(grid), outside), grid, outside)  # NaN and inf too
    grid = op.Transpose(grid, perm=[0, 2, 3, 1, 4, 5])  # (B, M, L, Q, K, 2)

    weights = _cast(attention_weights, ctype)
    # A non-finite weight (inf, NaN) becomes NaN, so that its (batch, query, head) is NaN wherever
    # the sample lands, as in the operator (an inf times a sample's 0 or v would give NaN or inf).
    finite = op.Equal(op.Sub(weights, weights), op.CastLike(op.Constant(value_float=0.0), weights))
    weights = op.Where(finite, weights, op.CastLike(op.Constant(value_float=float("nan")), weights))
    weights = op.Transpose(weights, perm=[0, 2, 3, 1, 4])  # (B, M, L, Q, K)

    out = None
    for level in range(L):
        level_index = _ints(level)
        hw = op.Reshape(op.Gather(shapes, level_index, axis=0), _ints(2))  # [H_l, W_l]
        start = op.Gather(starts, level_index, axis=0)  # [start_l]
        end = op.Gather(ends, level_index, axis=0)  # [start_l + H_l * W_l]
        rows = op.Slice(channels_first, start, end, _ints(3))  # (B, M, D, H_l * W_l)
        image = op.Reshape(rows, op.Concat(batch_heads, _ints(D), hw, axis=0))  # (B * M, D, H_l, W_l)
        level_grid = op.Gather(grid, op.Constant(value_int=level), axis=2)  # (B, M, Q, K, 2)
        level_grid = op.Reshape(level_grid, op.Concat(batch_heads, queries, _ints(K, 2), axis=0))
        sampled = op.GridSample(image, level_grid, mode="bilinear", padding_mode="zeros", align_corners=0)
        level_weights = op.Gather(weights, op.Constant(value_int=level), axis=2)  # (B, M, Q, K)
        level_weights = op.Reshape(level_weights, op.Concat(batch_heads, _ints(1), queries, _ints(K), axis=0))
        # (B * M, D, Q, K) samples weighted and summed over the points: (B * M, D, Q).
        level_out = op.ReduceSum(op.Mul(sampled, level_weights), _ints(3), keepdims=0)
        out = level_out if out is None else op.Add(out, level_out)

    out = op.Reshape(out, op.Concat(batch, _ints(M * D), queries, axis=0))  # (B, M * D, Q)
    out = op.Transpose(out, perm=[0, 2, 1])  # (B, Q, M * D)
    return _cast(out, value.dtype)


def _plugin_op(domain: str, name: str, attributes: list) -> Op:
    """A custom-domain op with its schema (the exporter's tracer needs one; nothing registers it
    globally). Both plugins take float32 or float16, one dtype for the three float inputs."""
    schema = onnx.defs.OpSchema(
        name,
        domain,
        1,
        inputs=[
            onnx.defs.OpSchema.FormalParameter("value", "T"),
            onnx.defs.OpSchema.FormalParameter("spatial_shapes", "tensor(int32)"),
            onnx.defs.OpSchema.FormalParameter("level_start_index", "tensor(int32)"),
            onnx.defs.OpSchema.FormalParameter("sampling_locations", "T"),
            onnx.defs.OpSchema.FormalParameter("attention_weights", "T"),
        ],
        outputs=[onnx.defs.OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "value's dtype")],
        attributes=attributes,
    )
    return Op(Opset(domain, 1), name, schema)


def _plugin_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    # int32 level shapes by a Cast of the int64 ones (no ScatterND, which older TensorRT parsers
    # import only through a plugin), and the float inputs in value's dtype.
    return (
        value,
        _cast(spatial_shapes, ir.DataType.INT32),
        _cast(level_start_index, ir.DataType.INT32),
        _cast(sampling_locations, value.dtype),
        _cast(attention_weights, value.dtype),
    )


def msda_forward_mmdeploy(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """`msda::forward` as mmdeploy's `mmdeploy::MMCVMultiScaleDeformableAttention` node, whose
    output is the operator's (B, Q, M * D)."""
    attribute = onnx.defs.OpSchema.Attribute(
        "im2col_step", onnx.defs.OpSchema.AttrType.INT, "batch chunk of the original kernel", required=False
    )
    plugin = _plugin_op(MMDEPLOY_DOMAIN, MMDEPLOY_OP, [attribute])
    args = _plugin_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return plugin(*args, im2col_step=MMDEPLOY_IM2COL_STEP)


def msda_forward_nvidia(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """`msda::forward` as NVIDIA's `MultiscaleDeformableAttnPlugin_TRT` node, whose 4-D output
    (B, Q, M, D) is reshaped to the operator's (B, Q, M * D)."""
    plugin = _plugin_op(NVIDIA_DOMAIN, NVIDIA_OP, [])
    args = _plugin_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    heads_times_dim = _static(value, 2, "value", "head count M") * _static(value, 3, "value", "head dim D")
    return op.Reshape(plugin(*args), _ints(0, 0, heads_times_dim))  # 0: that dim of the input


def _softmax(attention_logits, *others) -> ir.Value:
    """The softmax operators' weights: `Softmax` over the L * K logits of each (batch, query,
    head), in float32 (float64 for float64 inputs) as the operator computes it; (B, Q, M, L, K)."""
    L = _static(attention_logits, 3, "attention_logits", "level count L")
    K = _static(attention_logits, 4, "attention_logits", "point count K")
    inputs = (attention_logits, *others)
    ctype = ir.DataType.DOUBLE if any(t.dtype == ir.DataType.DOUBLE for t in inputs) else ir.DataType.FLOAT
    flat = op.Reshape(_cast(attention_logits, ctype), _ints(0, 0, 0, L * K))  # 0: that dim of the input
    return op.Reshape(op.Softmax(flat, axis=-1), _ints(0, 0, 0, L, K))


def _with_softmax(translation: Callable) -> Callable:
    """The translation of `msda::forward_softmax` from that of `msda::forward`."""

    def forward_softmax(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
        weights = _softmax(attention_logits, value, sampling_locations)
        return translation(value, spatial_shapes, level_start_index, sampling_locations, weights)

    forward_softmax.__name__ = translation.__name__.replace("msda_forward", "msda_forward_softmax")
    forward_softmax.__doc__ = f"`msda::forward_softmax`: a `Softmax` of the logits, then {translation.__name__}."
    return forward_softmax


_TRANSLATIONS = {None: msda_forward, "mmdeploy": msda_forward_mmdeploy, "nvidia": msda_forward_nvidia}


def translation_table(plugin: str | None = None) -> dict[Callable, Callable]:
    """The `custom_translation_table` of `torch.onnx.export(..., dynamo=True)` for msda's operators
    (`msda::forward` and `msda::forward_softmax`).

    Args:
        plugin: None for standard ONNX operators (no plugin needed), "mmdeploy" or "nvidia" for
            one custom node of that TensorRT plugin.
    """
    if plugin not in _TRANSLATIONS:
        raise ValueError(f"plugin must be None or one of {', '.join(map(repr, PLUGINS))}, got {plugin!r}")
    translation = _TRANSLATIONS[plugin]
    return {
        torch.ops.msda.forward.default: translation,
        torch.ops.msda.forward_softmax.default: _with_softmax(translation),
    }


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...] = (),
    f: Any = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    plugin: str | None = None,
    custom_translation_table: Mapping[Callable, Callable] | None = None,
    **options: Any,
) -> torch.onnx.ONNXProgram:
    """`torch.onnx.export(model, args, f, dynamo=True, ...)` with msda's operator translated.

    Args:
        model, args, f, kwargs, dynamic_shapes: as for `torch.onnx.export`.
        plugin: None (standard ONNX operators), "mmdeploy" or "nvidia": see `translation_table`.
        custom_translation_table: more translations, added to msda's.
        **options: any other keyword of `torch.onnx.export` (`opset_version`, `input_names`,
            `external_data`, ...).

    With `dynamic_shapes`, a module is first exported by `torch.export.export(strict=False)`, so a
    dim declared dynamic that the model's code fixes raises torch.export's constraint error: given
    the module, `torch.onnx.export` would replace it by its example value and carry on, and the
    ONNX model would then accept only that size.
    """
    if options.pop("dynamo", True) is not True:
        raise ValueError("msda.onnx.export runs the dynamo exporter only (dynamo=True)")
    table = translation_table(plugin)
    table.update(custom_translation_table or {})
    if isinstance(model, torch.nn.Module) and dynamic_shapes is not None:
        if model.training:  # torch.onnx.export's warning, which a program given to it skips
            warnings.warn("exporting a model in training mode: call model.eval() first", UserWarning, stacklevel=2)
        args = args if isinstance(args, tuple) else (args,)
        model = torch.export.export(
            model, args, kwargs=kwargs, dynamic_shapes=_export_dims(dynamic_shapes), strict=False
        )
        args, kwargs = (), None
    return torch.onnx.export(
        model,
        args,
        f,
        kwargs=kwargs,
        dynamic_shapes=dynamic_shapes,
        dynamo=True,
        custom_translation_table=table,
        **options,
    )


def _export_dims(dynamic_shapes: Any) -> Any:
    """torch.onnx's dynamic_shapes for torch.export: a dim named by a string becomes Dim.DYNAMIC
    (which, like a Dim, raises if the model fixes it)."""
    if isinstance(dynamic_shapes, str):
        return Dim.DYNAMIC
    if isinstance(dynamic_shapes, Mapping):
        return {key: _export_dims(value) for key, value in dynamic_shapes.items()}
    if isinstance(dynamic_shapes, (list, tuple)):
        return type(dynamic_shapes)(_export_dims(value) for value in dynamic_shapes)
    return dynamic_shapes
