"""GPU tier: the float32 encoder backward's last level summed in a shared-memory tile
(msda/kernels/shared_tile.py, launch.SHARED_TILE; bench/NOTES.md entry 49) against the
float64 oracle: at the encoder preset, at shapes the preset does not reach (samples outside,
queries not a multiple of a program's, a last level of exactly launch.SHARED_TILE_PIXELS pixels
and one past it, an expanded grad_output, no level starts), through the operator called eagerly,
and under torch.compile (the traced backward calls it through msda::add_shared_tile_); its
compile begun by the forward (kernels/ahead.py) under the key its launch looks up."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import msda
from msda import eager
from msda.kernels import ahead, launch
from msda.testing import PRESETS, Shape, make_inputs

from ..helpers import assert_matches_reference, forward_backward, random_like_output

ENCODER_LEVELS = ((24, 30), (12, 15), (6, 8), (3, 4))


@pytest.fixture(autouse=True)
def shared_tile(monkeypatch):
    if launch.msda_shared_tile_kernel is None or not launch.register_target(torch.device("cuda")):
        pytest.skip("the shared tile needs triton's Gluon and a Hopper GPU (launch.shared_tile_applies)")
    monkeypatch.setattr(launch, "SHARED_TILE", True)


def encoder(levels, seed, **kwargs):
    S = sum(h * w for h, w in levels)
    shape = Shape(batch=2, queries=S, heads=8, head_dim=32, levels=levels, points=4)
    return make_inputs(shape, torch.float32, "cuda", seed=seed, **kwargs)


def kernel_names(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("dist", ["uniform", "local"])
def test_encoder_preset(dist):
    inputs = make_inputs(PRESETS["encoder"], torch.float32, "cuda", dist=dist, seed=88)
    grad_output = random_like_output(inputs)
    results = []
    names = kernel_names(lambda: results.append(forward_backward(inputs, grad_output)))
    assert "msda_shared_tile_kernel" in names
    assert_matches_reference(inputs, results[0], grad_output)


@pytest.mark.parametrize(
    "levels",
    [ENCODER_LEVELS, ((8, 142), (4, 71)), ((10, 114), (5, 57))],
    ids=["small", "last-level-284-pixels", "last-level-285-pixels"],
)
def test_levels_inside_and_past_the_tile(levels):
    """A quarter of the samples outside; S = Q = 960, 1420, 1425: not multiples of the 256 queries
    of a program. The tile holds launch.SHARED_TILE_PIXELS = 284 pixels: the 285-pixel level is the
    backward kernel's to add (the tile kernel does nothing)."""
    assert 4 * 71 == launch.SHARED_TILE_PIXELS  # the two levels straddle the tile's size
    inputs = encoder(levels, seed=89, outside_fraction=0.25)
    grad_output = random_like_output(inputs)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)


def test_expanded_grad_output_and_no_level_starts():
    inputs = encoder(ENCODER_LEVELS, seed=90, outside_fraction=0.25)
    B, Q, MD = inputs.attention_weights.shape[0], inputs.attention_weights.shape[1], 8 * 32
    grad_output = torch.randn(B, 1, MD, device="cuda").expand(B, Q, MD)
    assert_matches_reference(inputs, forward_backward(inputs, grad_output), grad_output)

    def without_starts(value, shapes, starts, loc, attn):
        return msda.multi_scale_deformable_attention(value, shapes, None, loc, attn)

    assert_matches_reference(inputs, forward_backward(inputs, grad_output, without_starts), grad_output)


def test_eager_launch_after_a_one_query_call(monkeypatch):
    """Triton compiles the tile kernel's integer arguments by value class (num_queries = 1 as a
    constant): the eager path's cached kernel from a call with one query and one pixel must not
    serve a later call of the same settings with 256 (msda/kernels/direct.py)."""
    monkeypatch.setattr(eager._shared_tile_kernel, "compiled", {})
    results = []
    for levels, seed in [(((1, 1),), 91), (((16, 16),), 92)]:
        inputs = encoder(levels, seed=seed)
        grad_output = random_like_output(inputs)
        names = kernel_names(lambda: results.append(forward_backward(inputs, grad_output)))
        assert "msda_shared_tile_kernel" in names
        assert_matches_reference(inputs, results[-1], grad_output)


def test_operator_called_eagerly():
    inputs = encoder(ENCODER_LEVELS, seed=91, outside_fraction=0.25)
    grad_output = random_like_output(inputs)
    value, shapes, starts, loc, attn = inputs.args()
    out = torch.ops.msda.forward(value, shapes, starts, loc, attn)
    grads = []
    names = kernel_names(lambda: grads.extend(torch.ops.msda.backward(grad_output, value, shapes, starts, loc, attn)))
    assert "msda_shared_tile_kernel" in names
    assert_matches_reference(inputs, (out, *grads), grad_output)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled(dynamic):
    """torch.compile traces the operator's backward body, and the tile kernel runs through
    msda::add_shared_tile_ (Inductor keeps it an opaque call): with static shapes, and under
    dynamic shapes too, where this sequence (a static compile of the same function first) makes
    dynamo give Q and S two symbols (bench/NOTES.md entry 51) and the rule answers from the
    traced sizes. The gradients of the oracle, and no recompile for a second image size."""
    compiled = torch.compile(msda.multi_scale_deformable_attention, fullgraph=True, dynamic=dynamic)
    for call, levels in enumerate((ENCODER_LEVELS, ((20, 26), (10, 13), (5, 7), (3, 4)))):
        inputs = encoder(levels, seed=92 + call, outside_fraction=0.25)
        grad_output = random_like_output(inputs)
        results = []
        with torch.compiler.set_stance("fail_on_recompile" if dynamic and call else "default"):
            names = kernel_names(lambda: results.append(forward_backward(inputs, grad_output, compiled)))
        assert "msda_shared_tile_kernel" in names
        assert_matches_reference(inputs, results[0], grad_output)


@pytest.mark.parametrize("route", ["fast-path", "operator"])
def test_compiled_ahead_by_the_forward(route, monkeypatch):
    """A forward whose backward takes the tile compiles the tile kernel in a thread
    (launch.compile_backward_ahead) under the key the backward's launch looks up: the launch
    compiles nothing more."""
    kernel = launch.msda_shared_tile_kernel
    monkeypatch.setattr(ahead, "_started", set())  # as in a new process: nothing compiled yet
    monkeypatch.setattr(launch, "_AHEAD_CALLS", set())
    monkeypatch.setattr(eager._shared_tile_kernel, "compiled", {})
    kernel.device_caches.clear()
    inputs = encoder(ENCODER_LEVELS, seed=93, outside_fraction=0.25)
    grad_output = random_like_output(inputs)
    value, shapes, starts, loc, attn = inputs.args()
    value, loc, attn = (t.detach().clone().requires_grad_() for t in (value, loc, attn))
    if route == "fast-path":
        out = msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    else:
        out = torch.ops.msda.forward(value, shapes, starts, loc, attn)
    ahead.wait(kernel)
    compiled = kernel.device_caches[value.device.index][0]
    assert len(compiled) == 1  # compiled by the thread, before any backward
    grads = []
    names = kernel_names(lambda: grads.extend(torch.autograd.grad(out, (value, loc, attn), grad_output)))
    assert "msda_shared_tile_kernel" in names and len(compiled) == 1
    assert_matches_reference(inputs, (out.detach(), *grads), grad_output)


def test_left_out_where_the_rule_says(monkeypatch):
    """Where the tile applies to a call's shape, it is still not taken with MSDA_SHARED_TILE=0,
    in the deterministic mode (no kernel of its own: the lists sum grad_value), nor by a
    bfloat16 encoder or a float32 decoder (Q != S): the kernels launched say so."""
    inputs = encoder(ENCODER_LEVELS, seed=95)
    grad_output = random_like_output(inputs)

    def run():
        forward_backward(inputs, grad_output)

    assert "msda_shared_tile_kernel" in kernel_names(run)
    monkeypatch.setattr(launch, "SHARED_TILE", False)
    assert "msda_shared_tile_kernel" not in kernel_names(run)
    monkeypatch.setattr(launch, "SHARED_TILE", True)
    torch.use_deterministic_algorithms(True)
    try:
        assert "msda_shared_tile_kernel" not in kernel_names(run)
    finally:
        torch.use_deterministic_algorithms(False)
    half = make_inputs(Shape(batch=2, queries=960, heads=8, head_dim=32, levels=ENCODER_LEVELS, points=4),
                       torch.bfloat16, "cuda", seed=95)  # fmt: skip
    assert "msda_shared_tile_kernel" not in kernel_names(lambda: forward_backward(half, random_like_output(half)))
    decoder = make_inputs(Shape(batch=2, queries=100, heads=8, head_dim=32, levels=ENCODER_LEVELS, points=4),
                          torch.float32, "cuda", seed=95)  # fmt: skip
    assert "msda_shared_tile_kernel" not in kernel_names(
        lambda: forward_backward(decoder, random_like_output(decoder))
    )
