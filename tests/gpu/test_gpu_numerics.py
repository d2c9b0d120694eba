"""GPU tier: the Triton kernels at the presets of docs/benchmarking.md against the float64 reference,
for every dtype, mixed location/value dtypes, both location distributions."""

import dataclasses
import math
from unittest import mock

import pytest
import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

import msda
from msda import eager, ops, torch_impl
from msda.kernels import direct, launch
from msda.kernels.backward import (
    NATIVE_MIN_ELEMENTS,
    SAMPLES_PER_REPLICA,
    folds_in_kernel,
    grad_value_accumulator_dtype,
    replica_rows,
)
from msda.testing import PRESETS, Shape, make_inputs, reference, reference_with_grads, relative_error, tolerance

from ..helpers import (
    assert_matches_reference,
    atomic_fixed_point_grad_value,
    forward_backward,
    listed_grad_value,
    random_like_output,
    sorted_lists_grad_value,
)

CASES = [
    # (value dtype, locations/weights dtype)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),  # mixed precision: float32 locations, half value
    (torch.bfloat16, torch.float32),
]


def test_cuda_runs_the_triton_kernels():
    assert ops.uses_triton(torch.device("cuda"))


@pytest.mark.parametrize("dist", ["uniform", "local"])
@pytest.mark.parametrize("dtype,loc_dtype", CASES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_preset_matches_reference(preset, dtype, loc_dtype, dist):
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", loc_dtype=loc_dtype, dist=dist, seed=3)
    grad_output = random_like_output(inputs)
    errors = assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)
    print(preset, dist, dtype, loc_dtype, {k: f"{v:.2e}" for k, v in errors.items()})


def _forget_launches():
    """Drop the launch settings and eager launches kept so far (each cache is keyed by a call's
    shapes and dtypes alone, not by the module flags a test changes)."""
    launch._forward_constexprs.cache_clear()
    launch._backward_constexprs.cache_clear()
    for launches in (eager._forward_launches, eager._backward_launches, eager._fold_launches):
        launches.clear()
    for launcher in (eager._forward_kernel, eager._backward_kernel, eager._fold_kernel, *eager._LISTS.values()):
        launcher.compiled.clear()


@pytest.fixture
def unchecked_triton_release():
    """What a triton release other than those the kernels were checked on runs (launch.py's
    LANE_AXES and SHARED_TILE_TRITON, direct.py's C_LAUNCH_TRITON): each config's own loop in
    place of the lane placement, no shared tile, and eager launches through `CompiledKernel[grid]`."""
    with pytest.MonkeyPatch.context() as patch:
        _forget_launches()
        patch.setattr(launch, "LANE_AXIS", None)
        patch.setattr(direct, "C_LAUNCH_TRITON", {})
        patch.setattr(launch, "SHARED_TILE", False)  # Gluon's kernel, also taken on 3.6 alone
        yield
    _forget_launches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_preset_matches_reference_on_an_unchecked_triton(unchecked_triton_release, preset, dtype):
    """A triton release the layouts were not read on runs without the lane placement (and, as
    3.7 and 3.8 do, launches through the public route): checked here on this one."""
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", seed=23)
    _, _, constexprs = launch.forward_call(*inputs.args(), torch.empty(0, device="cuda"))
    assert not constexprs["LANE_PLACEMENT"]
    grad_output = random_like_output(inputs)
    first = forward_backward(inputs, grad_output)  # compiles, through the JIT
    errors = assert_matches_reference(inputs, first, grad_output)
    print(preset, dtype, {k: f"{v:.2e}" for k, v in errors.items()})
    public_route = mock.patch.object(
        CompiledKernel, "__getitem__", autospec=True, side_effect=CompiledKernel.__getitem__
    )
    with public_route as public:
        again = forward_backward(inputs, grad_output)
    assert public.call_count > 0 and torch.equal(again[0], first[0])


@pytest.fixture
def other_lane_axis():
    """The lane placement's tile in the order the installed triton does not take (launch.LANE_AXES:
    3.6 lanes first, 3.7 and 3.8 third), whose gathers Triton lays out otherwise."""
    with pytest.MonkeyPatch.context() as patch:
        _forget_launches()
        patch.setattr(launch, "LANE_AXIS", 2 if launch.LANE_AXIS == 0 else 0)
        yield launch.LANE_AXIS
    _forget_launches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_preset_matches_reference_in_the_other_lane_order(other_lane_axis, preset, dtype):
    """The lane placement's gathers are right in any layout (sampling.from_lane): with the tile in
    the other order, which this release lays out with exchanges through shared memory, the
    presets still match the oracle, so a release that lays it out otherwise is slower, not wrong."""
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", seed=29)
    _, _, forward = launch.forward_call(*inputs.args(), torch.empty(0, device="cuda"))
    assert forward["LANE_PLACEMENT"] and forward["LANE_AXIS"] == other_lane_axis
    grad_output = random_like_output(inputs)
    errors = assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)
    print(preset, dtype, other_lane_axis, {k: f"{v:.2e}" for k, v in errors.items()})


def test_float64_matches_reference():
    inputs = make_inputs(PRESETS["decoder"], torch.float64, "cuda", seed=4)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_levels_of_a_pixel_under_many_queries(dtype):
    """The GPU fuzz's counterexample (bench/NOTES.md entry 97): four 1 x 1 levels beside one of
    31 x 30 at 0.996 samples a value row, 186 samples on each 1 x 1 pixel of a (batch, head);
    with no replicas under one sample a row, bfloat16's grad_value was 2.2e-2 off."""
    shape = Shape(batch=1, queries=93, heads=9, head_dim=256, levels=((1, 1),) * 4 + ((31, 30),), points=2)
    inputs = make_inputs(shape, dtype, "cuda", seed=0)
    assert inputs.value.numel() >= NATIVE_MIN_ELEMENTS  # native half-precision sums
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("starts", [True, False], ids=["starts", "summed"])
def test_replicas_folded_by_the_backward_kernel(dtype, starts):
    """The decoder preset with its coarsest level shrunk to 2 x 2 (300 samples a pixel: 13
    replicas): its replicas folded by the backward kernel's last program of each (batch, head),
    which must see every other program's adds (backward.folds_in_kernel; each of 32 heads has
    150 programs), within the bound, with level_start_index and with the sizes summed."""
    shape = dataclasses.replace(PRESETS["decoder"], levels=PRESETS["decoder"].levels[:3] + ((2, 2),))
    inputs = make_inputs(shape, dtype, "cuda", seed=5)
    Q, S, L, K = shape.queries, shape.num_values, len(shape.levels), shape.points
    assert folds_in_kernel(replica_rows(dtype, Q, S, L, K), shape.head_dim)
    grad_output = random_like_output(inputs)

    def fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return msda.multi_scale_deformable_attention(
            value, spatial_shapes, level_start_index if starts else None, sampling_locations, attention_weights
        )

    assert_matches_reference(inputs, forward_backward(inputs, grad_output, fn), grad_output)


@pytest.mark.parametrize("preset,replicated", [("decoder", [1, 1, 1, 1]), ("encoder", [1, 1, 4, 14])])
def test_grad_value_accumulation_rule(preset, replicated):
    """The documented rule: native atomics in every dtype on sm_90 (float32 for bfloat16 before
    it), and in half precision replicas of a level's rows where it has over SAMPLES_PER_REPLICA
    samples a pixel: none at the decoder (a buffer and a fold with nothing in them), the two
    coarsest levels at the encoder."""
    shape = PRESETS[preset]
    device = torch.device("cuda")
    for dtype in (torch.float16, torch.bfloat16):
        native = dtype == torch.float16 or torch.cuda.get_device_capability() >= (9, 0)
        value = torch.empty(shape.batch, shape.num_values, shape.heads, shape.head_dim, dtype=dtype, device=device)
        chosen = grad_value_accumulator_dtype(value, shape.queries, len(shape.levels), shape.points)
        assert chosen == (dtype if native else torch.float32)
    for dtype in (torch.float32, torch.float64):
        assert replica_rows(dtype, shape.queries, shape.num_values, len(shape.levels), shape.points) is None
    rows = replica_rows(torch.float16, shape.queries, shape.num_values, len(shape.levels), shape.points)
    # level_replicas' formula (a jit function, not callable from Python) at the preset's level sizes:
    # the rule's outcome, not the kernel's arithmetic (test_triton_kernels.py's replicas test runs that).
    used, counts = 0, []
    for h, w in shape.levels:
        samples_a_pixel = math.ceil(shape.queries * shape.points / (h * w))
        wanted = math.ceil(samples_a_pixel / SAMPLES_PER_REPLICA.value)
        counts.append(max(1, min(wanted, 1 + (rows - used) // (h * w))))
        used += (counts[-1] - 1) * h * w
    assert counts == replicated and used <= rows


@pytest.mark.parametrize("dist", ["uniform", "local"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_lists_sum_the_bits_of_the_atomic_fixed_point_path(monkeypatch, preset, dtype, dist):
    """The deterministic mode's grad_value from its lists summed in fixed point (kernels/
    deterministic.py, at the rule's tiles: a decoder's joined runs, not sorted here, an encoder's
    side by side) equals, bit for bit, the 64-bit atomic adds of the same fixed-point
    contributions (the fused-softmax kernels' path), at the presets: lists of up to a thousand
    samples and more on the encoder's coarse levels."""
    monkeypatch.setattr(launch, "LIST_SORTED", False)
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist=dist, seed=7)
    grad_output = random_like_output(inputs)
    atomic = atomic_fixed_point_grad_value(grad_output, *inputs.args())
    listed = listed_grad_value(
        lambda kernel, grid, args, constexprs: kernel[grid](*args, **constexprs), grad_output, *inputs.args()
    )  # (asserts every sample listed as counted)
    assert torch.equal(listed, atomic)
    assert atomic.abs().amax() > 0


@pytest.mark.parametrize("dist", ["uniform", "local", "one point"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sorted_lists_sum_the_same_bits_in_any_slot_order(dtype, dist):
    """At the decoder preset, the lists sorted and summed in float32 (the rule's): shuffling each
    list's slots (the atomics' order) before the sort leaves the bits unchanged, and grad_value
    is within the oracle's bound; "one point": every sample at one location, 1,200 entries a list."""
    inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", dist="uniform" if dist == "one point" else dist, seed=7)
    assert launch.list_rule(inputs.sampling_locations.shape[1], inputs.value.shape[1], inputs.value).sorted_sums
    if dist == "one point":
        inputs.sampling_locations.fill_(0.43)
    grad_output = random_like_output(inputs)
    first, longest = sorted_lists_grad_value(grad_output, *inputs.args())
    assert longest >= (1200 if dist == "one point" else 2)
    again, _ = sorted_lists_grad_value(grad_output, *inputs.args(), seed=3)
    assert torch.equal(again, first)
    assert relative_error(first, reference_with_grads(inputs, grad_output)[1]) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["decoder", "encoder"])
def test_deterministic_mode_gives_bitwise_identical_gradients(deterministic_algorithms, preset, dtype):
    """docs/contract.md: under torch.use_deterministic_algorithms(True) the gradients are bitwise equal
    run to run, from the lists' kernels (not the pure-PyTorch fallback): the encoder's summed in
    fixed point, the decoder's sorted and summed in float32 (launch.list_rule), within the same
    bounds. Local locations: at the encoder hundreds of adds land on some value rows, where the
    default atomic backward's order varies."""
    inputs = make_inputs(PRESETS[preset], dtype, "cuda", dist="local", seed=5)
    grad_output = random_like_output(inputs)
    with (
        mock.patch.object(torch_impl, "backward", wraps=torch_impl.backward) as pure_pytorch,
        mock.patch.object(launch, "fixed_point_scales", wraps=launch.fixed_point_scales) as fixed_point,
    ):
        first = forward_backward(inputs, grad_output)
        assert_matches_reference(inputs, first, grad_output)
        for run in range(2):
            again = forward_backward(inputs, grad_output)
            for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_attn"), first, again):
                assert torch.equal(a, b), f"run {run + 2}: {name} differs"
    assert pure_pytorch.call_count == 0
    assert fixed_point.call_count == (3 if preset == "encoder" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d).removeprefix("torch."))
def test_eager_calls_on_misaligned_views(dtype):
    """Contiguous views one element past an allocation (data pointers not 16-byte aligned) are not
    what the eager path's cached kernels were compiled for (msda/kernels/direct.py): they take
    Triton's JIT path, and give the aligned call's output, bit for bit, and gradients within the
    bounds; an aligned call after them does too."""
    inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", seed=12)
    grad_output = random_like_output(inputs)
    tensors = (inputs.value, inputs.sampling_locations, inputs.attention_weights)

    def shifted(t):  # the same values, one element past a fresh allocation
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)

    def results(value, loc, attn):
        leaves = [t.requires_grad_() for t in (value, loc, attn)]
        out = msda.multi_scale_deformable_attention(value, inputs.spatial_shapes, inputs.level_start_index, loc, attn)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_output))

    aligned = results(*(t.detach().clone() for t in tensors))
    views = [shifted(t) for t in tensors]
    assert all(v.is_contiguous() and v.data_ptr() % 16 for v in views)
    for got in (results(*views), results(*(t.detach().clone() for t in tensors))):
        torch.testing.assert_close(got[0], aligned[0], rtol=0, atol=0)
        assert_matches_reference(inputs, got, grad_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_eager_launches_call_tritons_c_launcher(dtype):
    """Past a key's first call, eager launches call Triton's C launcher directly, neither through
    `CompiledKernel[grid]` nor through the JIT's `kernel[grid]` (msda/kernels/direct.py), on the
    triton releases whose launcher it was checked against (C_LAUNCH_TRITON): a launcher that
    changed within one fails here rather than quietly costing a slower route. Other releases
    take `CompiledKernel[grid]`. Outputs are the same bits."""
    inputs = make_inputs(PRESETS["decoder"], dtype, "cuda", seed=13)
    grad_output = random_like_output(inputs)
    first = forward_backward(inputs, grad_output)  # compiles, through the JIT
    public_route = mock.patch.object(
        CompiledKernel, "__getitem__", autospec=True, side_effect=CompiledKernel.__getitem__
    )
    jit_route = mock.patch.object(JITFunction, "run", autospec=True, side_effect=JITFunction.run)
    with public_route as public, jit_route as jit:
        again = forward_backward(inputs, grad_output)
    assert jit.call_count == 0
    assert (public.call_count == 0) == (direct.TRITON_RELEASE in direct.C_LAUNCH_TRITON)
    assert torch.equal(again[0], first[0])
    assert_matches_reference(inputs, again, grad_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_eager_forwards_reuse_a_prepared_launch(dtype):
    """A second eager forward of a call's shapes, dtypes and flags takes the launch the first one
    prepared (msda/eager.py: no argument builder), on its own tensors: its output is the oracle's.
    A value 8 bytes past an allocation has the same key but not the 16-byte alignment the kernel
    was compiled for: that call goes the long way (Triton's JIT), with the same bits."""
    first, second = (make_inputs(PRESETS["decoder"], dtype, "cuda", seed=seed) for seed in (15, 16))

    def forward(inputs, value=None):
        with torch.no_grad():
            return msda.multi_scale_deformable_attention(
                inputs.value if value is None else value, inputs.spatial_shapes, inputs.level_start_index,
                inputs.sampling_locations, inputs.attention_weights,
            )  # fmt: skip

    forward(first)
    with mock.patch.object(launch, "forward_call", wraps=launch.forward_call) as builder:
        out = forward(second)
        assert builder.call_count == 0
        value = second.value
        shifted = torch.empty(value.numel() + 8 // value.element_size(), dtype=dtype, device="cuda")
        shifted = shifted[8 // value.element_size():].view(value.shape).copy_(value)
        assert shifted.data_ptr() % 16 == 8 and shifted.storage_offset() % 2 == 0
        torch.testing.assert_close(forward(second, shifted), out, rtol=0, atol=0)
        assert builder.call_count == 1
    expected = reference(second.value, second.spatial_shapes, second.sampling_locations, second.attention_weights)
    assert relative_error(out, expected) <= tolerance(dtype)


@pytest.mark.parametrize(
    "dtype, queries", [(torch.float32, 300), (torch.float16, 300), (torch.float16, 900)], ids=str
)  # fmt: skip
def test_eager_backwards_reuse_a_prepared_launch(dtype, queries):
    """A second eager backward of a plain call's shapes, dtypes and strides (the decoder's:
    grad_value zeros, and in float16 their replicas, that the kernel alone adds into) takes the
    launches the first one prepared, the fold's too where the replicas take the fold kernel (900
    queries: `backward.folds_in_kernel`), with no argument builder (msda/eager.py), on its own
    tensors, within the oracle's bound. A grad_output 8 bytes past an allocation has the same key
    but not the 16-byte alignment the kernel was compiled for: that call goes the long way
    (Triton's JIT), as accurate."""
    shape = dataclasses.replace(PRESETS["decoder"], queries=queries)
    first, second = (make_inputs(shape, dtype, "cuda", seed=seed) for seed in (17, 18))
    forward_backward(first, random_like_output(first))
    grad_output = random_like_output(second, seed=2)
    shift = 8 // grad_output.element_size()
    shifted = torch.empty(grad_output.numel() + shift, dtype=dtype, device="cuda")
    shifted = shifted[shift:].view(grad_output.shape).copy_(grad_output)
    assert shifted.data_ptr() % 16 == 8
    with (
        mock.patch.object(launch, "backward_call", wraps=launch.backward_call) as builder,
        mock.patch.object(launch, "fold_call", wraps=launch.fold_call) as fold_builder,
        mock.patch.object(launch, "fold_tensors", wraps=launch.fold_tensors) as folds,
    ):
        prepared = forward_backward(second, grad_output)
        assert builder.call_count == 0 and fold_builder.call_count == 0
        assert folds.call_count == (1 if queries == 900 else 0)  # the fold kernel, prepared
        long_way = forward_backward(second, shifted)
        assert builder.call_count == 1
    assert_matches_reference(second, prepared, grad_output)
    assert_matches_reference(second, long_way, grad_output)


def test_eager_launches_call_a_set_launch_hook():
    """A launch hook (a profiler's, such as proton's) is called for every eager launch: with one
    set, launches take Triton's JIT path, which calls it; the output is the same bits."""
    inputs = make_inputs(PRESETS["decoder"], torch.float32, "cuda", seed=14)
    args = (inputs.value, inputs.spatial_shapes, inputs.level_start_index, inputs.sampling_locations,
            inputs.attention_weights)  # fmt: skip
    plain = msda.multi_scale_deformable_attention(*args)  # compiled, then cached for the direct launch
    launches = []

    def hook(metadata):
        launches.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hooked = msda.multi_scale_deformable_attention(*args)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launches) == 1
    assert torch.equal(hooked, plain)
    msda.multi_scale_deformable_attention(*args)
    assert len(launches) == 1
