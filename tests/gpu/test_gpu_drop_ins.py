"""GPU tier: the extension-module and mmcv drop-ins take the eager fast path on CUDA.

Deformable DETR's Function (through `MultiScaleDeformableAttention` as csrc_free_ops.install()
provides it), mmcv's Function and mmcv's ext_module forward and backward launch the compiled
kernels directly (msda/eager.py), without the registered operator: the operator's forward bit for
bit, its location and weight gradients bit for bit (no atomics in them), grad_value within the
bound (atomic adds in another order), all within the bound of the float64 oracle.
"""

from unittest import mock

import pytest
import torch

from csrc_free_ops import mmcv as mmcv_patch
from msda import eager
from msda.testing import PRESETS, TOLERANCE, make_inputs, relative_error

from ..helpers import assert_matches_reference, forward_backward, random_like_output
from ..test_extension_drop_in import models_ops  # noqa: F401  (the fixture)


def _mmcv_function(value, shapes, starts, loc, attn):
    return mmcv_patch.MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, attn, 64)


@pytest.mark.parametrize("drop_in", ["extension", "mmcv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_drop_ins_launch_the_kernels_directly(drop_in, dtype, request):
    if drop_in == "extension":
        function = request.getfixturevalue("models_ops")

        def call(value, shapes, starts, loc, attn):
            return function.apply(value, shapes, starts, loc, attn, 64)

    else:
        call = _mmcv_function
    inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", outside_fraction=0.1, seed=11)
    grad_output = random_like_output(inputs)
    with (
        mock.patch.object(eager, "launch_forward", wraps=eager.launch_forward) as forward_spy,
        mock.patch.object(eager, "launch_backward", wraps=eager.launch_backward) as backward_spy,
    ):
        fast = forward_backward(inputs, grad_output, call)
    assert forward_spy.call_count == 1 and backward_spy.call_count == 1
    _assert_is_the_operators(inputs, grad_output, fast)


def test_mmcv_ext_module_launches_the_kernels_directly():
    """mmcv's ext_module, as its once-differentiable Function calls it (grad mode off): the
    forward returns the output, the backward writes into its zeroed gradients."""
    inputs = make_inputs(PRESETS["decoder"], torch.float16, "cuda", outside_fraction=0.1, seed=12)
    grad_output = random_like_output(inputs)
    grads = [torch.zeros_like(t) for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)]
    with (
        mock.patch.object(eager, "launch_forward", wraps=eager.launch_forward) as forward_spy,
        mock.patch.object(eager, "launch_backward", wraps=eager.launch_backward) as backward_spy,
        torch.no_grad(),
    ):
        out = mmcv_patch.ext_module.ms_deform_attn_forward(*inputs.args(), im2col_step=64)
        mmcv_patch.ext_module.ms_deform_attn_backward(*inputs.args(), grad_output, *grads, im2col_step=64)
    assert forward_spy.call_count == 1 and backward_spy.call_count == 1
    _assert_is_the_operators(inputs, grad_output, (out, *grads))


def _assert_is_the_operators(inputs, grad_output, fast):
    args = inputs.args()
    out = torch.ops.msda.forward(*args)
    grad_value, grad_loc, grad_attn = torch.ops.msda.backward(grad_output, *args)
    assert torch.equal(fast[0], out)
    assert torch.equal(fast[2], grad_loc) and torch.equal(fast[3], grad_attn)
    assert relative_error(fast[1], grad_value) <= TOLERANCE[inputs.value.dtype]
    assert_matches_reference(inputs, fast, grad_output)
