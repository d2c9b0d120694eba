"""A Deformable-DETR-style block on msda.MultiScaleDeformableAttention, its inputs and a float64
oracle, shared by the CPU and GPU compile / CUDA-graph / export tests."""

from __future__ import annotations

import copy
import math
from unittest import mock

import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.export import Dim

import msda
from msda.testing import TOLERANCE, reference, reference_softmax, relative_error

D_MODEL, LEVELS, HEADS, POINTS, D_FFN = 64, 2, 4, 3, 128
STRIDES = (8, 16)  # one feature level per stride, as a backbone's C3 and C4

# Input sizes for torch.compile(dynamic=True). Dynamo's duck sizing gives equal-valued input sizes
# one symbol, and sizes 0 and 1 are always specialized: the batch, query and token counts of the
# first call must not be 0, 1, equal to one another or to another input size (2: xy and LEVELS;
# 64: D_MODEL), or they stay tied to it and the next call recompiles. Inductor on CPU also guards
# on which side of 4096 the float32 sums of the bias gradients (over B * S and B * Q rows) are,
# so B * S stays above 4096 (S is 1600, 1500 or 2400 here) and B * Q below.
IMAGE_SIZES = ((320, 256), (240, 320), (384, 320))  # (H, W) in pixels
CALLS = (  # (batch, image size, queries): three image sizes, two batch sizes, four query counts
    (3, IMAGE_SIZES[0], 50),
    (5, IMAGE_SIZES[1], 70),
    (3, IMAGE_SIZES[2], 90),
    (5, IMAGE_SIZES[0], 33),
)


class DeformableDecoderBlock(nn.Module):
    """The cross-attention half of a Deformable DETR decoder layer (dropout left out):
    multi-scale deformable attention from the queries into the flattened feature levels
    (value projection, offset and weight projections, softmax, the operator, output projection),
    residual and LayerNorm, then a ReLU FFN, residual and LayerNorm."""

    def __init__(self, d_model=D_MODEL, n_levels=LEVELS, n_heads=HEADS, n_points=POINTS, d_ffn=D_FFN):
        super().__init__()
        self.cross_attn = msda.MultiScaleDeformableAttention(d_model, n_levels, n_heads, n_points)
        self.norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, query, reference_points, memory, spatial_shapes, level_start_index):
        x = query + self.cross_attn(query, reference_points, memory, spatial_shapes, level_start_index)
        x = self.norm1(x)
        return self.norm2(x + self.linear2(torch.relu(self.linear1(x))))


def make_block(device="cpu", seed=0, fused_softmax=True) -> DeformableDecoderBlock:
    """A block whose parameters are all perturbed from their initialization, so that attention
    is not uniform, offsets depend on the query and no sample sits on the pixel lattice (where
    bilinear interpolation has kinks and the one-sided gradient depends on rounding)."""
    torch.manual_seed(seed)
    block = DeformableDecoderBlock()
    block.cross_attn.fused_softmax = fused_softmax
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return block.to(device)


def level_shapes(image_size) -> list[tuple[int, int]]:
    h, w = image_size
    return [(math.ceil(h / s), math.ceil(w / s)) for s in STRIDES]


def make_inputs(batch, image_size, queries, device="cpu", seed=0, requires_grad=False):
    """(query, reference_points, memory, spatial_shapes, level_start_index) for the block."""
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(level_shapes(image_size), dtype=torch.int64)
    tokens = int(shapes.prod(1).sum())
    args = (
        torch.randn(batch, queries, D_MODEL, generator=gen),
        torch.rand(batch, queries, LEVELS, 2, generator=gen),
        torch.randn(batch, tokens, D_MODEL, generator=gen),
        shapes,
        msda.level_start_index_from_shapes(shapes),
    )
    args = tuple(t.to(device) for t in args)
    if requires_grad:
        args[0].requires_grad_()
        args[2].requires_grad_()
    return args


def cotangent(out: Tensor, seed=1) -> Tensor:
    """A fixed random gradient for the output. (A sum or mean of a LayerNorm output has no
    gradient but rounding: comparing such gradients would compare noise.)"""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen).to(out.device, out.dtype)


def outputs_and_grads(block, args, grad_output=None):
    """(output, {name: gradient}) of one forward and backward of `block` (a module, compiled or
    not), for its parameters and the query and memory inputs, all cloned. The inputs are detached
    copies; the parameters' grads are set to None first and left in place (for an optimizer)."""
    args = tuple(a.detach().clone() for a in args)
    args[0].requires_grad_()
    args[2].requires_grad_()
    block.zero_grad(set_to_none=True)
    out = block(*args)
    out.backward(cotangent(out) if grad_output is None else grad_output)
    # A compiled module's parameters are its original module's, named with an _orig_mod. prefix.
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in block.named_parameters()}
    grads["query"], grads["memory"] = args[0].grad, args[2].grad
    return out.detach().clone(), grads


def oracle_outputs_and_grads(block, args, grad_output):
    """The same in float64 on the inputs' device, with the operators replaced by
    msda.testing.reference and reference_softmax (written from the definition, independent of
    the operators)."""

    def reference_op(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return reference(value, spatial_shapes, sampling_locations, attention_weights)

    def reference_softmax_op(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
        return reference_softmax(value, spatial_shapes, sampling_locations, attention_logits)

    block64 = copy.deepcopy(block).double()
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    with (
        mock.patch.object(msda.layer, "multi_scale_deformable_attention", reference_op),
        mock.patch.object(msda.layer, "multi_scale_deformable_attention_softmax", reference_softmax_op),
    ):
        return outputs_and_grads(block64, args64, grad_output.double())


def assert_within(actual, expected, bound: float, what: str = "") -> dict[str, float]:
    """Assert relative_error(actual[k], expected[k]) <= bound for every key of two dicts of
    tensors (or for two tensors); returns the errors."""
    if isinstance(actual, Tensor):
        actual, expected = {"output": actual}, {"output": expected}
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} != {sorted(expected)}"
    errors = {name: relative_error(actual[name], expected[name]) for name in expected}
    bad = {name: error for name, error in errors.items() if not error <= bound}
    assert not bad, f"{what}: relative errors {bad} exceed {bound:.0e}"
    return errors


def dynamic_shapes():
    """torch.export dynamic_shapes for the block: batch, query count and token count (the
    image size) are dynamic; the level table (L, 2) and its start index (L,) are static."""
    batch, queries, tokens = Dim("batch", min=1), Dim("queries", min=1), Dim("tokens", min=1)
    return {
        "query": {0: batch, 1: queries},
        "reference_points": {0: batch, 1: queries},
        "memory": {0: batch, 1: tokens},
        "spatial_shapes": None,
        "level_start_index": None,
    }


def msda_forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's calls of msda's forward operators (the layer calls msda::forward_softmax, or
    msda::forward with fused_softmax=False)."""
    targets = (torch.ops.msda.forward.default, torch.ops.msda.forward_softmax.default)
    return [node for node in graph.nodes if node.target in targets]


# The checks shared by the CPU tier (tests/test_layer_compile_export.py, the pure-PyTorch path
# inside the operator) and the GPU tier (tests/gpu, the Triton kernels).


def check_one_graph_for_all_sizes(device, fused_softmax=True) -> None:
    """torch.compile(fullgraph=True, dynamic=True) of the block: the first call compiles one
    graph (forward and backward), which then serves every call of CALLS with no recompilation;
    outputs and gradients equal eager and the float64 oracle within the float32 bound of docs/contract.md."""
    torch._dynamo.reset()
    counters.clear()
    block = make_block(device, fused_softmax=fused_softmax)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    bound = TOLERANCE[torch.float32]
    for call, (batch, image_size, queries) in enumerate(CALLS):
        args = make_inputs(batch, image_size, queries, device, seed=call)
        # The first call is the warm-up that compiles; after it a recompilation raises.
        with torch.compiler.set_stance("default" if call == 0 else "fail_on_recompile"):
            out, grads = outputs_and_grads(compiled, args)
        expected_out, expected_grads = outputs_and_grads(block, args)
        oracle_out, oracle_grads = oracle_outputs_and_grads(block, args, cotangent(out))
        where = f"call {call} (batch {batch}, image {image_size}, {queries} queries)"
        # The float32 bound of docs/contract.md (1e-5) for all four comparisons. The gradients go through
        # atomic adds on the GPU, in another order each run, which changes their float32 rounding
        # only (here a grad_value row sums a handful of samples: about 1e-7 relative). Measured on
        # CPU: at most 7e-7 against eager, 1.3e-6 against the oracle (attention_weights.weight).
        assert_within(out, expected_out, bound, f"{where}: compiled output vs eager")
        assert_within(grads, expected_grads, bound, f"{where}: compiled gradients vs eager")
        assert_within(out, oracle_out, bound, f"{where}: compiled output vs float64 oracle")
        assert_within(grads, oracle_grads, bound, f"{where}: compiled gradients vs float64 oracle")
    # One frame, one graph: a graph break would make two, a recompilation one more. (Not a
    # CompileCounter backend: it counts backend calls, and under dynamic=True nn.LayerNorm's float
    # eps makes dynamo restart its first analysis once, calling the backend twice for one graph.)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def export_block(block) -> torch.export.ExportedProgram:
    """torch.export.export of the block at batch 3, 50 queries and a 320x256 image, with batch,
    queries and image size (token count) dynamic."""
    device = next(block.parameters()).device
    example = make_inputs(3, IMAGE_SIZES[0], 50, device)
    return torch.export.export(block, example, dynamic_shapes=dynamic_shapes())


def check_export_round_trip(device, path, fused_softmax=True) -> None:
    """torch.export of the block with dynamic batch, queries and image size: the operator is
    one node (msda::forward_softmax, or msda::forward with fused_softmax=False); the program and
    its torch.export.save / load round trip match eager at other sizes (batch 1 included)."""
    block = make_block(device, fused_softmax=fused_softmax).eval()
    exported = export_block(block)
    op = torch.ops.msda.forward_softmax.default if fused_softmax else torch.ops.msda.forward.default
    assert [node.target for node in msda_forward_nodes(exported.graph)] == [op], exported.graph
    torch.export.save(exported, path)
    loaded = torch.export.load(path)
    assert [node.target for node in msda_forward_nodes(loaded.graph)] == [op], loaded.graph

    bound = TOLERANCE[torch.float32]
    for seed, (batch, image_size, queries) in enumerate([(5, IMAGE_SIZES[1], 70), (1, IMAGE_SIZES[2], 7)], 1):
        args = make_inputs(batch, image_size, queries, device, seed=seed)
        with torch.no_grad():
            expected = block(*args)
            assert_within(exported.module()(*args), expected, bound, f"exported, batch {batch}")
            assert_within(loaded.module()(*args), expected, bound, f"saved and loaded, batch {batch}")
