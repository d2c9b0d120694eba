"""The eager fast path on CPU (msda/eager_cpu.py): the functional form's eager calls on CPU tensors
skip the registered operator, and give bitwise what the operator gives; anything it cannot take
goes through the operator."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import msda
from msda import eager_cpu, ops, torch_impl
from msda.testing import Shape, make_inputs

from .helpers import forward_backward, operator_bodies, random_like_output

SHAPE = Shape(batch=2, queries=7, heads=2, head_dim=4, levels=((5, 6), (3, 2), (1, 1)), points=2)


def _operator(softmax: bool):
    op = torch.ops.msda.forward_softmax if softmax else torch.ops.msda.forward
    return lambda value, shapes, starts, loc, attn: op(value, shapes, starts, loc, attn)


@pytest.fixture(autouse=True)
def pure_pytorch_backend(monkeypatch):
    monkeypatch.setattr(ops, "BACKEND", "torch")


@pytest.mark.parametrize("softmax", [False, True], ids=["weights", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_eager_cpu_calls_skip_the_operator_and_match_it(softmax, dtype):
    inputs = make_inputs(SHAPE, dtype, outside_fraction=0.2, seed=3)
    grad_output = random_like_output(inputs)
    functional = msda.multi_scale_deformable_attention_softmax if softmax else msda.multi_scale_deformable_attention
    with (
        mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast,
        mock.patch.object(torch_impl, "_cpu_backward", wraps=torch_impl._cpu_backward) as cpu_backward,
        operator_bodies() as entered,
    ):
        got = forward_backward(inputs, grad_output, functional)
    assert fast.call_count == 1 and cpu_backward.call_count == 1 and entered() == 0
    with mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast, operator_bodies() as entered:
        want = forward_backward(inputs, grad_output, _operator(softmax))
    assert fast.call_count == 0 and entered() == 2  # the operator's forward and backward
    for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_attn"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_level_start_index_none_and_no_grad():
    """level_start_index=None takes the fast path too; under no_grad, on inputs that require grad,
    it records no autograd Function (and with grad mode on it does)."""
    inputs = make_inputs(SHAPE, torch.float32, seed=4, requires_grad=True)
    value, shapes, starts, loc, attn = inputs.args()
    with (
        mock.patch.object(eager_cpu, "_Function", wraps=eager_cpu._Function) as function,
        mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast,
        operator_bodies() as entered,
    ):
        with torch.no_grad():
            out = msda.multi_scale_deformable_attention(value, shapes, None, loc, attn)
        assert function.apply.call_count == 0 and fast.call_count == 1 and entered() == 0
        assert not out.requires_grad
        with_grad = msda.multi_scale_deformable_attention(value, shapes, None, loc, attn)
        assert function.apply.call_count == 1 and fast.call_count == 2 and entered() == 0
    assert with_grad.requires_grad
    with torch.no_grad():
        assert torch.equal(out, torch.ops.msda.forward(value, shapes, starts, loc, attn))


def test_double_backward_goes_through_the_operator():
    """create_graph: the fast path's backward calls msda::backward, whose own derivative the
    second backward needs; the result is the operator path's."""
    inputs = make_inputs(SHAPE, torch.float64, seed=5)

    def second_order(fn):
        value, shapes, starts, loc, attn = (t.detach().clone() for t in inputs.args())
        for t in (value, loc, attn):
            t.requires_grad_()
        out = fn(value, shapes, starts, loc, attn)
        (grad_value,) = torch.autograd.grad(out.square().sum(), value, create_graph=True)
        return torch.autograd.grad(grad_value.square().sum(), (value, loc, attn))

    with mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast:
        got = second_order(msda.multi_scale_deformable_attention)
    assert fast.call_count == 1
    want = second_order(_operator(False))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_what_the_fast_path_leaves_to_the_operator(monkeypatch):
    inputs = make_inputs(SHAPE, torch.float32, seed=6)
    value, shapes, starts, loc, attn = inputs.args()
    assert eager_cpu.eligible(value, shapes, starts, loc, attn)
    assert eager_cpu.eligible(value, shapes, None, loc, attn)
    assert not eager_cpu.eligible(value, shapes.tolist(), starts, loc, attn)  # not a tensor: the checks say so
    assert not eager_cpu.eligible(torch.nn.Parameter(value), shapes, starts, loc, attn)  # a subclass
    with torch.autograd.forward_ad.dual_level():
        assert not eager_cpu.eligible(value, shapes, starts, loc, attn)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not eager_cpu.eligible(value, shapes, starts, loc, attn)
    monkeypatch.setattr(ops, "BACKEND", "triton")  # CPU tensors in Triton's interpreter: the operator's
    assert not eager_cpu.eligible(value, shapes, starts, loc, attn)
