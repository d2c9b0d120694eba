"""csrc_free_ops.install(): Deformable DETR's `models/ops` code runs on msda through
`import MultiScaleDeformableAttention`, with any im2col_step."""

import importlib
import sys
from types import ModuleType
from unittest import mock

import pytest
import torch
import torch._dynamo.testing

import csrc_free_ops
from msda import eager, eager_cpu, ops
from msda.testing import Shape, make_inputs
from msda.testing_cases import BAD_CALLS, FORWARD_ARGS, valid_args

from .helpers import assert_matches_reference, forward_backward, operator_bodies, random_like_output

# Batch 3: im2col_step 2 does not divide it (the compiled op would refuse), 64 exceeds it.
SHAPE = Shape(batch=3, queries=11, heads=2, head_dim=8, levels=((7, 9), (4, 5), (2, 3)), points=3)


# The call pattern of Deformable DETR's models/ops/functions/ms_deform_attn_func.py (written
# here): the extension imported by name at the top, im2col_step kept on ctx, a once-differentiable
# backward that unpacks the extension's list.
MODELS_OPS_FUNCTIONS = """
import torch
from torch.autograd.function import Function, once_differentiable

import MultiScaleDeformableAttention as MSDA


class MSDeformAttnFunction(Function):
    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations,
                attention_weights, im2col_step):
        ctx.im2col_step = im2col_step
        output = MSDA.ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                                             sampling_locations, attention_weights, ctx.im2col_step)
        ctx.save_for_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                              attention_weights)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad_value, grad_sampling_loc, grad_attn_weight = MSDA.ms_deform_attn_backward(
            *ctx.saved_tensors, grad_output, ctx.im2col_step)
        return grad_value, None, None, grad_sampling_loc, grad_attn_weight, None
"""


@pytest.fixture
def models_ops(tmp_path, monkeypatch):
    """install(), then import the model code fresh: its MSDeformAttnFunction. Both imports are
    undone after the test (monkeypatch restores the extension's sys.modules entry)."""
    monkeypatch.setitem(sys.modules, "MultiScaleDeformableAttention", None)
    csrc_free_ops.install()
    (tmp_path / "ms_deform_attn_func.py").write_text(MODELS_OPS_FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("ms_deform_attn_func").MSDeformAttnFunction
    del sys.modules["ms_deform_attn_func"]


@pytest.mark.parametrize("im2col_step", [2, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deformable_detr_function_matches_reference(models_ops, im2col_step, dtype):
    inputs = make_inputs(SHAPE, dtype, outside_fraction=0.1)
    grad_output = random_like_output(inputs)

    def through_extension(value, shapes, starts, loc, attn):
        return models_ops.apply(value, shapes, starts, loc, attn, im2col_step)

    assert_matches_reference(inputs, forward_backward(inputs, grad_output, through_extension), grad_output)


def test_eager_cpu_calls_take_the_fast_path_and_match_the_operator(models_ops, monkeypatch):
    """The model code's Function on CPU tensors: the extension's forward and backward run the CPU
    path's functions without the registered operator (msda/eager_cpu.py), bitwise as it does."""
    monkeypatch.setattr(ops, "BACKEND", "torch")  # the CPU path, under any MSDA_BACKEND
    inputs = make_inputs(SHAPE, torch.float32, outside_fraction=0.1, seed=6)
    grad_output = random_like_output(inputs)
    with (
        mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast_forward,
        mock.patch.object(eager_cpu, "backward", wraps=eager_cpu.backward) as fast_backward,
        operator_bodies() as entered,
    ):
        got = forward_backward(inputs, grad_output, lambda *args: models_ops.apply(*args, 64))
        assert fast_forward.call_count == 1 and fast_backward.call_count == 1 and entered() == 0

        def operator(value, shapes, starts, loc, attn):
            return torch.ops.msda.forward(value, shapes, starts, loc, attn)

        want = forward_backward(inputs, grad_output, operator)
        assert fast_forward.call_count == 1 and fast_backward.call_count == 1 and entered() == 2
    for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_attn"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("drop_in", ["extension", "mmcv"])
def test_drop_ins_compile_fullgraph_and_match_eager(models_ops, drop_in):
    """Inside torch.compile the drop-ins' fast paths step aside for the operator, with no graph
    break: Deformable DETR's Function around the extension, and mmcv's Function."""
    from csrc_free_ops import mmcv as mmcv_patch

    function = models_ops if drop_in == "extension" else mmcv_patch.MultiScaleDeformableAttnFunction

    def loss(value, shapes, starts, loc, attn):
        return function.apply(value, shapes, starts, loc, attn, 64).square().sum()

    inputs = make_inputs(SHAPE, torch.float32, outside_fraction=0.1, seed=9)
    grad_output = torch.ones(())
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = forward_backward(inputs, grad_output, torch.compile(loss, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    for got, want in zip(compiled, forward_backward(inputs, grad_output, loss)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_backward_with_grad_mode_on_goes_through_the_operator(monkeypatch):
    """A backward that records a graph (create_graph) needs the operator's double backward: the
    CPU fast path's backward is for grad mode off only."""
    monkeypatch.setattr(ops, "BACKEND", "torch")
    inputs = make_inputs(SHAPE, torch.float64, seed=7)
    grad_output = random_like_output(inputs)
    value = inputs.value.detach().clone().requires_grad_()
    args = (value, *inputs.args()[1:])
    with mock.patch.object(eager_cpu, "backward", wraps=eager_cpu.backward) as fast_backward:
        with torch.enable_grad():
            grad_value, _, _ = eager.backward(grad_output, *args)
        assert fast_backward.call_count == 0 and grad_value.requires_grad
        with torch.no_grad():
            eager.backward(grad_output, *args)
        assert fast_backward.call_count == 1


def test_backward_returns_a_list_of_three_gradients(monkeypatch):
    monkeypatch.setitem(sys.modules, "MultiScaleDeformableAttention", None)
    csrc_free_ops.install()
    import MultiScaleDeformableAttention as ext

    inputs = make_inputs(SHAPE)
    grads = ext.ms_deform_attn_backward(*inputs.args(), random_like_output(inputs), 2)
    assert isinstance(grads, list) and len(grads) == 3
    for grad, like in zip(grads, (inputs.value, inputs.sampling_locations, inputs.attention_weights)):
        assert grad.shape == like.shape and grad.dtype == like.dtype


@pytest.mark.parametrize(
    "case,backward",
    [
        pytest.param(case, backward, id=f"{'backward' if backward else 'forward'}-{case.id}")
        for case in BAD_CALLS
        if case.dispatcher_rejects
        for backward in (False, True)
        if backward or "forward" in case.entries  # (grad_output: the backward's alone)
    ],
)
def test_non_tensor_arguments_raise_a_type_error_naming_them(case, backward):
    """A list, an array, a scalar or a nested tensor where the extension takes a tensor: a
    TypeError naming the argument (pybind's error type in the compiled extension), not the
    dispatcher's RuntimeError from torch.ops.msda.* further down."""
    args = case.edit(valid_args())
    forward_args = [args[name] for name in FORWARD_ARGS]
    with pytest.raises(TypeError, match=case.argument):
        if backward:
            csrc_free_ops.extension.ms_deform_attn_backward(*forward_args, args["grad_output"], 64)
        else:
            csrc_free_ops.extension.ms_deform_attn_forward(*forward_args, 64)


def test_install_replaces_a_compiled_extension(monkeypatch):
    monkeypatch.setitem(sys.modules, "MultiScaleDeformableAttention", ModuleType("MultiScaleDeformableAttention"))
    assert csrc_free_ops.install() is csrc_free_ops.MultiScaleDeformableAttention
    import MultiScaleDeformableAttention

    assert MultiScaleDeformableAttention is csrc_free_ops.MultiScaleDeformableAttention
