"""GPU tier: the softmax operators (msda::forward_softmax / msda::backward_softmax and
msda.multi_scale_deformable_attention_softmax) on the compiled Triton kernels.

At the presets of docs/benchmarking.md against the float64 oracle (msda.testing.reference_softmax)
for every dtype, mixed location/value dtypes and both location distributions; the eager fast path
against the registered operator; non-finite logits; the bad-input battery through the softmax
entry points; opcheck; deterministic mode; the layer fused against unfused. torch.compile, CUDA
graphs and export of the layer (which calls the softmax operator by default) are in
test_gpu_compile.py, test_gpu_cuda_graphs.py and test_gpu_export.py.
"""

from unittest import mock

import pytest
import torch

import msda
from msda import eager
from msda.testing import PRESETS, TOLERANCE, Shape, make_inputs, relative_error

from msda.testing_cases import BAD_CALLS, valid_args

from ..helpers import assert_matches_reference, forward_backward, random_like_output
from ..test_edge_cases import backend
from ..test_softmax import SOFTMAX_BATTERY, _call_softmax, assert_softmax_call_rejected
from ..test_softmax import test_non_finite_logits as check_non_finite_logits
from .test_gpu_numerics import CASES

fused = msda.multi_scale_deformable_attention_softmax


def _inputs(shape, dtype, loc_dtype=None, dist="uniform", seed=0, requires_grad=False):
    """Logits N(0, 1) in place of the weights (make_inputs(logits=True))."""
    return make_inputs(
        shape, dtype, "cuda", loc_dtype=loc_dtype, dist=dist, seed=seed, requires_grad=requires_grad, logits=True
    )


@pytest.mark.parametrize("dist", ["uniform", "local"])
@pytest.mark.parametrize("dtype,loc_dtype", CASES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_preset_matches_reference(preset, dtype, loc_dtype, dist):
    inputs = _inputs(PRESETS[preset], dtype, loc_dtype, dist, seed=7)
    grad_output = random_like_output(inputs)
    results = forward_backward(inputs, grad_output, fn=fused)
    errors = assert_matches_reference(inputs, results, grad_output, softmax=True)
    print(preset, dist, dtype, loc_dtype, {k: f"{v:.2e}" for k, v in errors.items()})


@pytest.mark.parametrize("fused_kernels", [True, False], ids=["fused", "torch-softmax"])
def test_both_softmax_forms_match_reference(monkeypatch, fused_kernels):
    """launch.FUSED_SOFTMAX (the kernels normalize the logits; off by default, slower; their first GPU
    version gave NaN everywhere, bench/NOTES.md entry 18) and the default (torch.softmax, then the
    plain kernels)."""
    from msda.kernels import launch

    monkeypatch.setattr(launch, "FUSED_SOFTMAX", fused_kernels)
    inputs = _inputs(PRESETS["decoder"], torch.float32, seed=7)
    grad_output = random_like_output(inputs)
    results = forward_backward(inputs, grad_output, fn=fused)
    assert_matches_reference(inputs, results, grad_output, softmax=True)


def test_float64_matches_reference():
    inputs = _inputs(PRESETS["decoder"], torch.float64, seed=8)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output, fn=fused), grad_output, softmax=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eager_fast_path_equals_the_operator(dtype, monkeypatch):
    """With the fused kernels (launch.FUSED_SOFTMAX) the functional form on CUDA launches them
    directly (msda/eager.py; its float32 backward keeps the weights' gradient in grad_logits
    itself, the operator in a scratch of its own): the same forward bit for bit, the same location
    and logit gradients bit for bit (no atomics in them), grad_value within the bound (atomic
    adds in another order)."""
    from msda.kernels import launch

    monkeypatch.setattr(launch, "FUSED_SOFTMAX", True)
    inputs = _inputs(PRESETS["decoder"], dtype, seed=9)
    grad_output = random_like_output(inputs)
    with (
        mock.patch.object(eager, "launch_forward", wraps=eager.launch_forward) as forward_spy,
        mock.patch.object(eager, "launch_backward", wraps=eager.launch_backward) as backward_spy,
    ):
        fast = forward_backward(inputs, grad_output, fn=fused)
    assert forward_spy.call_count == 1 and backward_spy.call_count == 1
    assert all(call.args[-1] is True for call in (*forward_spy.call_args_list, *backward_spy.call_args_list))

    args = inputs.args()
    out = torch.ops.msda.forward_softmax(*args)
    grad_value, grad_loc, grad_logits = torch.ops.msda.backward_softmax(grad_output, *args)
    assert torch.equal(fast[0], out)
    assert torch.equal(fast[2], grad_loc) and torch.equal(fast[3], grad_logits)
    assert relative_error(fast[1], grad_value) <= TOLERANCE[dtype]
    assert_matches_reference(inputs, (out, grad_value, grad_loc, grad_logits), grad_output, softmax=True)


def test_level_start_index_none():
    inputs = _inputs(PRESETS["decoder"], torch.float32, seed=10)
    value, shapes, starts, loc, logits = inputs.args()
    assert torch.equal(fused(value, shapes, None, loc, logits), fused(value, shapes, starts, loc, logits))


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_non_finite_logits_on_cuda(path):
    check_non_finite_logits(path, "cuda")


@pytest.mark.parametrize("case,entry", [p for p in SOFTMAX_BATTERY if not p.values[0].needs_data])
def test_bad_call_raises_on_cuda(case, entry):
    """The battery through the softmax entry points on CUDA (the functional form's eager fast
    path checks the arguments itself): the operators' errors, naming attention_logits."""
    with backend("triton"):
        assert_softmax_call_rejected(case, entry, valid_args("cuda"))


@pytest.mark.parametrize("case", [c for c in BAD_CALLS if c.needs_data], ids=lambda c: c.id)
@pytest.mark.parametrize("entry", ["functional", "forward_softmax", "backward_softmax"])
def test_unchecked_data_stays_in_bounds_on_cuda(case, entry):
    """Inconsistent level data runs unchecked on CUDA (no host sync): no fault, finite results."""
    with backend("triton"):
        results = _call_softmax(entry, case.edit(valid_args("cuda")))
        torch.cuda.synchronize()
    for result in results if isinstance(results, tuple) else (results,):
        assert torch.isfinite(result).all(), f"{entry}: non-finite result"


# opcheck (as test_gpu_opcheck.py: float32 and float64, int64 and int32 level shapes).
OPCHECK_SHAPE = Shape(batch=3, queries=7, heads=2, head_dim=8, levels=((6, 5), (3, 3)), points=3)
OPCHECK_CASES = [(torch.float32, torch.int64), (torch.float64, torch.int64), (torch.float32, torch.int32)]


def _opcheck_inputs(dtype, index_dtype, requires_grad):
    inputs = _inputs(OPCHECK_SHAPE, dtype, requires_grad=requires_grad, seed=11)
    inputs.spatial_shapes = inputs.spatial_shapes.to(index_dtype)
    inputs.level_start_index = inputs.level_start_index.to(index_dtype)
    return inputs


@pytest.mark.parametrize("dtype,index_dtype", OPCHECK_CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_opcheck_forward_softmax_on_cuda(dtype, index_dtype):
    inputs = _opcheck_inputs(dtype, index_dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.msda.forward_softmax.default, inputs.args())


@pytest.mark.parametrize("dtype,index_dtype", OPCHECK_CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_opcheck_backward_softmax_on_cuda(dtype, index_dtype):
    inputs = _opcheck_inputs(dtype, index_dtype, requires_grad=False)
    grad_output = random_like_output(inputs)
    torch.library.opcheck(torch.ops.msda.backward_softmax.default, (grad_output, *inputs.args()))
    expanded = grad_output.new_ones(()).expand(grad_output.shape)
    torch.library.opcheck(torch.ops.msda.backward_softmax.default, (expanded, *inputs.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_mode_gives_bitwise_identical_gradients(deterministic_algorithms, dtype):
    inputs = _inputs(PRESETS["encoder"], dtype, dist="local", seed=12)
    grad_output = random_like_output(inputs)
    first = forward_backward(inputs, grad_output, fn=fused)
    assert_matches_reference(inputs, first, grad_output, softmax=True)
    again = forward_backward(inputs, grad_output, fn=fused)
    for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_logits"), first, again):
        assert torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_layer_fused_and_unfused_agree(preset):
    """msda.MultiScaleDeformableAttention with fused_softmax=True (the default) and False, one
    state_dict, at the preset's sizes in float32: output and every parameter gradient within the
    float32 bound of each other."""
    shape = PRESETS[preset]
    d_model, levels = shape.heads * shape.head_dim, len(shape.levels)
    torch.manual_seed(0)
    layers = [
        msda.MultiScaleDeformableAttention(d_model, levels, shape.heads, shape.points, fused_softmax=f).cuda()
        for f in (True, False)
    ]
    with torch.no_grad():
        layers[0].attention_weights.weight.normal_(std=d_model**-0.5)  # uneven attention
        layers[0].sampling_offsets.weight.normal_(std=d_model**-0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    gen = torch.Generator().manual_seed(1)
    shapes = torch.tensor(shape.levels, device="cuda")
    query = torch.randn(shape.batch, shape.queries, d_model, generator=gen).cuda()
    reference_points = torch.rand(shape.batch, shape.queries, levels, 2, generator=gen).cuda()
    memory = torch.randn(shape.batch, shape.num_values, d_model, generator=gen).cuda()
    grad = torch.randn(shape.batch, shape.queries, d_model, generator=gen).cuda()
    results = []
    for layer in layers:
        out = layer(query, reference_points, memory, shapes, None)
        results.append((out, torch.autograd.grad(out, list(layer.parameters()), grad)))
    (out_fused, grads_fused), (out_unfused, grads_unfused) = results
    bound = TOLERANCE[torch.float32]
    assert relative_error(out_fused, out_unfused) <= bound
    for (name, _), a, b in zip(layers[0].named_parameters(), grads_fused, grads_unfused):
        assert relative_error(a, b) <= bound, name
