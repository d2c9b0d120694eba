"""GPU tier: the operator inside CUDA graphs. torch.compile(mode="reduce-overhead") runs the
inference and the training step of a Deformable-DETR-style block in CUDA graphs, with no graph
skipped; a no-grad forward captured with torch.cuda.graph replays on new data (new level shapes
included); torch.cuda.make_graphed_callables graphs forward and backward; all equal eager. And the
prerequisite of every capture: forward and backward never synchronize with the host. The
deterministic mode's backward, compiled and captured, equals its eager self bit for bit.

Warm-up before any capture: the first call of each dtype / shape bucket JIT-compiles the Triton
kernels (and cuBLAS sets up), which must not happen inside a capture. So one forward (and backward,
if it will be captured) runs on a side stream before torch.cuda.graph; make_graphed_callables and
reduce-overhead do that warm-up themselves."""

import contextlib
import copy

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import msda
from msda.kernels import launch
from msda.testing import PRESETS, TOLERANCE
from msda.testing import make_inputs as make_op_inputs

from ..detr_block import (
    IMAGE_SIZES,
    assert_within,
    cotangent,
    make_block,
    make_inputs,
    oracle_outputs_and_grads,
    outputs_and_grads,
)
from ..helpers import random_like_output

BOUND = TOLERANCE[torch.float32]
SIZE = (3, IMAGE_SIZES[0], 50)  # batch, image size, queries


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    cudagraph_trees.reset_cudagraph_trees()
    counters.clear()
    yield
    torch._dynamo.reset()
    cudagraph_trees.reset_cudagraph_trees()


def _no_cudagraph_skips():
    """Make inductor raise, with its reason, where it would skip a CUDA graph (where this torch
    has the switch; counters["inductor"]["cudagraph_skips"] is checked either way)."""
    if hasattr(torch._inductor.config.triton, "cudagraph_or_error"):
        return torch._inductor.config.patch({"triton.cudagraph_or_error": True})
    return contextlib.nullcontext()


def _recorded_cuda_graphs() -> int:
    """How many CUDA graphs inductor's CUDA graph trees have recorded on the current device."""
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    nodes = list(manager.get_roots()) if manager is not None else []
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


@pytest.mark.compile
def test_reduce_overhead_inference_runs_in_a_cuda_graph(fresh_dynamo):
    block = make_block("cuda").eval()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), _no_cudagraph_skips():
        for step in range(3):  # a warm-up run, the recording, a replay
            args = make_inputs(*SIZE, "cuda", seed=step)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*args).clone()  # the graph's output buffer is reused by the next replay
            assert_within(out, block(*args), BOUND, f"step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _recorded_cuda_graphs() >= 1


@pytest.mark.compile
def test_reduce_overhead_training_step_runs_in_cuda_graphs(fresh_dynamo):
    """Three steps (a warm-up run, the recording, a replay), each from the same parameters on
    both sides: eager's are copied into the compiled block's (in place: the graphs read them
    there). Compared step by step, not after several: the two sides' float32 rounding differs
    (atomic adds), and SGD compounds any difference, so parameters that drifted apart for two
    steps would compare the drift, not the step (1.03e-5 at step 1 on the H200 without the copy)."""
    eager = make_block("cuda")
    block = copy.deepcopy(eager)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    optimizers = {model: torch.optim.SGD(model.parameters(), lr=0.1) for model in (eager, block)}
    with _no_cudagraph_skips():
        for step in range(3):
            with torch.no_grad():
                for ours, theirs in zip(block.parameters(), eager.parameters()):
                    ours.copy_(theirs)
            args = make_inputs(*SIZE, "cuda", seed=step)
            expected_out, expected_grads = outputs_and_grads(eager, args)
            oracle_out, oracle_grads = oracle_outputs_and_grads(eager, args, cotangent(expected_out))
            torch.compiler.cudagraph_mark_step_begin()
            out, grads = outputs_and_grads(compiled, args)  # grads set to None, then backward
            assert_within(out, expected_out, BOUND, f"step {step}: output vs eager")
            assert_within(grads, expected_grads, BOUND, f"step {step}: gradients vs eager")
            assert_within(out, oracle_out, BOUND, f"step {step}: output vs float64 oracle")
            assert_within(grads, oracle_grads, BOUND, f"step {step}: gradients vs float64 oracle")
            for optimizer in optimizers.values():
                optimizer.step()  # the compiled side's from the gradients its graphs wrote
            assert_within(
                dict(block.named_parameters()), dict(eager.named_parameters()), BOUND, f"step {step}: parameters"
            )
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _recorded_cuda_graphs() >= 2  # the forward and, below it in the tree, the backward


def test_manual_capture_replays_on_new_data():
    block = make_block("cuda").eval()
    static_args = make_inputs(*SIZE, "cuda", seed=0)

    # Warm-up on a side stream: compiles the Triton kernels for this bucket outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        block(*static_args)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = block(*static_args)

    # New features, queries and reference points; the second replay also swaps the level shapes
    # for their transpose (same token count): the kernels read the shapes on the device.
    batch, (height, width), queries = SIZE
    for seed, image_size in ((1, (height, width)), (2, (width, height))):
        args = make_inputs(batch, image_size, queries, "cuda", seed=seed)
        for static, new in zip(static_args, args):
            static.copy_(new)
        graph.replay()
        with torch.no_grad():
            expected = block(*args)
        assert_within(static_out, expected, BOUND, f"replay on image {image_size}")


def test_make_graphed_callables_forward_and_backward():
    eager = make_block("cuda")
    block = copy.deepcopy(eager)
    sample = make_inputs(*SIZE, "cuda", seed=0)
    sample[0].requires_grad_()  # query and memory need grads, as in outputs_and_grads
    sample[2].requires_grad_()
    # Warms up (JIT compiles forward and backward kernels) on a side stream, then captures.
    graphed = torch.cuda.make_graphed_callables(block, sample)
    for seed in (1, 2):
        args = make_inputs(*SIZE, "cuda", seed=seed)
        out, grads = outputs_and_grads(graphed, args)
        expected_out, expected_grads = outputs_and_grads(eager, args)
        assert_within(out, expected_out, BOUND, f"seed {seed}: output")
        assert_within(grads, expected_grads, BOUND, f"seed {seed}: gradients")


def test_forward_and_backward_never_synchronize_with_the_host():
    block = make_block("cuda")
    args = make_inputs(*SIZE, "cuda", seed=0, requires_grad=True)
    # level_start_index None too: then the functional form computes it on the device.
    calls = [args, (*args[:4], None)]
    grad_output = cotangent(block(*args))  # made before the check: a copy from pageable memory syncs
    for call_args in calls:  # warm-up: kernels compiled, allocator and cuBLAS set up
        block(*call_args).backward(grad_output)
    torch.cuda.synchronize()

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call now raises
    try:
        for call_args in calls:
            block(*call_args).backward(grad_output)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@pytest.mark.parametrize("sums", ["sorted", "fixed point"])
def test_deterministic_mode_compiled_and_in_cuda_graphs(monkeypatch, deterministic_algorithms, sums):
    """The deterministic backward under torch.compile(fullgraph=True) and replayed from a CUDA graph
    gives the eager deterministic gradients bit for bit (nothing synchronizes with the host to
    break the capture, the fixed point's scale included): a decoder's lists sorted and summed in
    float32 (its rule), and summed in 64-bit fixed point (an encoder's rule)."""
    monkeypatch.setattr(launch, "LIST_SORTED", None if sums == "sorted" else False)
    torch._dynamo.reset()  # (a frame compiled under the other setting would be reused)
    inputs = make_op_inputs(PRESETS["decoder"], torch.float32, "cuda", dist="local", seed=8)
    grad_output = random_like_output(inputs)
    leaves = [
        t.detach().clone().requires_grad_()
        for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    ]
    shapes, starts = inputs.spatial_shapes, inputs.level_start_index

    def step(fn):
        value, loc, attn = leaves
        return torch.autograd.grad(fn(value, shapes, starts, loc, attn), leaves, grad_output)

    eager = step(msda.multi_scale_deformable_attention)
    compiled = step(torch.compile(msda.multi_scale_deformable_attention, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    side = torch.cuda.Stream()  # a warm-up on a side stream first (the module's docstring says why)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(msda.multi_scale_deformable_attention)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(msda.multi_scale_deformable_attention)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
    # Free the graph and its memory pool now, not at some later garbage collection, which could
    # fall inside another test's capture.
    del captured
    graph.reset()
