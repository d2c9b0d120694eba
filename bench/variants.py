"""The rows of the bench: each variant is a name and a builder of what one cell times.

A cell is one preset, dtype and distribution of sampling locations (PRESETS, DTYPES, DISTS), with
its inputs. A builder
takes the cell and returns a Case: callables for one forward call, one backward call, one
forward+backward step, and the output and gradients that the error columns compare with the
float64 oracle. A builder raises Unavailable when the variant cannot run here (a peer that is
not installed): the bench turns that into a row that says why.

Two scopes. "op" rows take the operator's inputs (value, spatial_shapes, level_start_index,
sampling_locations, attention_weights). "block" rows run Deformable DETR's attention layer
(msda.MultiScaleDeformableAttention, with its projections) on a query, reference points and the
flattened features; their gradients are those of input_flatten, reference_points and query. The
layer as users get it normalizes its attention logits inside the operator (the softmax operator);
the "block-unfused" rows run it with the separate softmax of the original layer, "block-deformops"
with the peer's fused softmax operator in place of msda's.
"""

from __future__ import annotations

import copy
import importlib
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor

import msda
import msda.layer
from msda.testing import PRESETS as MODEL_PRESETS
from msda.testing import DETR_LEVELS, Inputs, Shape, reference, reference_softmax, reference_with_grads

from .timing import capture_graph

# The cells' axes. decoder and encoder are the operating points of docs/benchmarking.md; smoke is
# tiny, for a CPU (and a quick look at a GPU): two levels, two heads, two points.
SMOKE = Shape(batch=2, queries=12, heads=2, head_dim=8, levels=((6, 8), (3, 4)), points=2)
# Other models' shapes, where the operating points' four levels of four points do not reach
# (bench/NOTES.md entry 91): DINO's (and Grounding DINO's) decoder, RT-DETR's decoder at 640 x 640,
# Mask2Former's pixel decoder at 512 x 512, BEVFormer's temporal self-attention (one 200 x 200
# level) and its spatial cross-attention (6 cameras at 928 x 1600, 8 points).
OTHER_MODELS = {
    "dino": Shape(batch=4, queries=900, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    "rtdetr": Shape(batch=4, queries=300, heads=8, head_dim=32, levels=((80, 80), (40, 40), (20, 20)), points=4),
    "mask2former": Shape(batch=8, queries=5376, heads=8, head_dim=32, levels=((16, 16), (32, 32), (64, 64)), points=4),
    "bevformer-tsa": Shape(batch=2, queries=40000, heads=8, head_dim=32, levels=((200, 200),), points=4),
    "bevformer-sca": Shape(
        batch=6, queries=3000, heads=8, head_dim=32, levels=((116, 200), (58, 100), (29, 50), (15, 25)), points=8
    ),
}
PRESETS = {"smoke": SMOKE, **MODEL_PRESETS, **OTHER_MODELS}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DISTS = ("uniform", "local")

RESULT_NAMES = {
    "op": ("output", "grad_value", "grad_sampling_locations", "grad_attention_weights"),
    "block": ("output", "grad_input_flatten", "grad_reference_points", "grad_query"),
}


class Unavailable(Exception):
    """The variant cannot run on this machine; the message says why."""


@dataclass
class Cell:
    preset: str
    shape: Shape
    dtype: torch.dtype
    dist: str
    device: torch.device
    inputs: Inputs  # the operator's inputs (no requires_grad)
    grad_output: Tensor  # (B, Q, M * D), the gradient fed to every backward
    compile_backend: str  # torch.compile's backend for the compiled rows
    compiled: dict  # layers and compiled callables kept across cells: compiled once per dtype
    memo: dict = field(default_factory=dict)  # per-cell leaves and oracles


@dataclass
class Case:
    forward: Callable[[], object]
    backward: Callable[[], object] | None  # one backward after a forward; None: step minus forward
    step: Callable[[], object]  # a forward and its backward
    results: Callable[[], tuple[Tensor, ...]]  # output and the three gradients (RESULT_NAMES)
    capture_backward: bool = False  # backward() alone can be captured in a CUDA graph
    capturable: bool = True  # forward() and step() can be captured (False: already CUDA graphs)
    # Drops what backward() keeps alive between calls (it makes it again when called): a forward
    # made on the default stream, whose leaves' AccumulateGrad nodes a capture of step() would
    # otherwise reuse, making the default stream wait inside the capture, which invalidates it.
    release: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Variant:
    name: str
    scope: str  # "op" or "block"
    baseline: bool  # what the ratio columns compare against, within the scope
    description: str
    build: Callable[[Cell], Case]
    needs_cuda: bool = False
    peer: str = ""  # a peer's package (its rows are left out by --peers without it); "" for msda's


# --- The pure-PyTorch baseline, as model code writes it --------------------------------------


def grid_sample_msda(
    value: Tensor, spatial_shapes: list[tuple[int, int]], sampling_locations: Tensor, attention_weights: Tensor
) -> Tensor:
    """MSDA in pure PyTorch as Deformable DETR, mmcv (`multi_scale_deformable_attn_pytorch`) and
    Hugging Face write it: split value per level, F.grid_sample each level (bilinear, zero padding,
    align_corners=False) at grid 2 * loc - 1, weight the samples and sum them. spatial_shapes is a
    list of (H, W) ints, as Hugging Face passes it so that torch.compile sees no tensor data."""
    B, _, M, D = value.shape
    _, Q, _, L, K, _ = sampling_locations.shape
    value_list = value.split([h * w for h, w in spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampled = []
    for level, (h, w) in enumerate(spatial_shapes):
        # (B, H*W, M, D) -> (B*M, D, H, W)
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(B * M, D, h, w)
        # (B, Q, M, K, 2) -> (B*M, Q, K, 2)
        grid_l = sampling_grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        # (B*M, D, Q, K)
        sampled.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    # (B, Q, M, L, K) -> (B*M, 1, Q, L*K)
    weights = attention_weights.transpose(1, 2).reshape(B * M, 1, Q, L * K)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(B, M * D, Q)
    return output.transpose(1, 2).contiguous()


# --- Oracles -----------------------------------------------------------------------------------


def expected(cell: Cell, scope: str) -> tuple[Tensor, ...]:
    """float64 output and gradients for `scope` (RESULT_NAMES order), computed once per cell."""
    key = ("expected", scope)
    if key not in cell.memo:
        if scope == "op":
            cell.memo[key] = reference_with_grads(cell.inputs, cell.grad_output)
        else:
            cell.memo[key] = _block_oracle(cell)
    return cell.memo[key]


def _oracle_core(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    return reference(value, spatial_shapes, sampling_locations, attention_weights)


def _oracle_softmax_core(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
    return reference_softmax(value, spatial_shapes, sampling_locations, attention_logits)


def _block_oracle(cell: Cell) -> tuple[Tensor, ...]:
    """The block in float64 (the same parameters and inputs, upcast) with the float64 reference
    in place of the operator (the softmax operator: the float64 softmax, then the reference).
    One oracle for every block row: fused or not, the layers have the same parameters."""
    layer = copy.deepcopy(_layer(cell)).double()
    leaves = tuple(t.detach().double().requires_grad_() for t in _block_leaves(cell))
    flat, ref, query = leaves
    with (
        mock.patch.object(msda.layer, "multi_scale_deformable_attention", _oracle_core),
        mock.patch.object(msda.layer, "multi_scale_deformable_attention_softmax", _oracle_softmax_core),
    ):
        out = layer(query, ref, flat, cell.inputs.spatial_shapes, cell.inputs.level_start_index)
    grads = torch.autograd.grad(out, leaves, cell.grad_output.double())
    return (out.detach(), *grads)


# --- Shared pieces -----------------------------------------------------------------------------


def _op_leaves(cell: Cell) -> tuple[Tensor, Tensor, Tensor]:
    """value, sampling_locations, attention_weights as leaves that require grad (one set a cell)."""
    if "op_leaves" not in cell.memo:
        i = cell.inputs
        cell.memo["op_leaves"] = tuple(
            t.detach().clone().requires_grad_() for t in (i.value, i.sampling_locations, i.attention_weights)
        )
    return cell.memo["op_leaves"]


def _block_leaves(cell: Cell) -> tuple[Tensor, Tensor, Tensor]:
    """input_flatten (B, S, C), reference_points (B, Q, L, 2), query (B, Q, C), requiring grad.

    The reference points are the cell's sampling locations of head 0, point 0 at each level, so
    the block samples near where the cell's distribution puts its points.
    """
    if "block_leaves" not in cell.memo:
        s = cell.shape
        gen = torch.Generator().manual_seed(2)
        channels = s.heads * s.head_dim
        flat = torch.randn(s.batch, s.num_values, channels, generator=gen)
        query = torch.randn(s.batch, s.queries, channels, generator=gen)
        ref = cell.inputs.sampling_locations[:, :, 0, :, 0, :].detach()
        cell.memo["block_leaves"] = tuple(
            t.to(cell.device, cell.dtype).clone().requires_grad_() for t in (flat, ref, query)
        )
    return cell.memo["block_leaves"]


def _layer(cell: Cell, fused_softmax: bool = True) -> msda.MultiScaleDeformableAttention:
    """The block's layer for the cell's dtype and sizes, made once (seeded: the same parameters
    with the softmax fused into the operator or not) and kept."""
    s = cell.shape
    key = ("layer", cell.dtype, s.heads, s.head_dim, len(s.levels), s.points, fused_softmax)
    if key not in cell.compiled:
        channels = s.heads * s.head_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            layer = msda.MultiScaleDeformableAttention(
                channels, len(s.levels), s.heads, s.points, fused_softmax=fused_softmax
            )
            # The original initialization zeroes the query's weights (no gradient would reach the
            # query): random ones give offsets of about a pixel and uneven attention.
            torch.nn.init.normal_(layer.sampling_offsets.weight, std=1 / math.sqrt(channels))
            torch.nn.init.normal_(layer.attention_weights.weight, std=1 / math.sqrt(channels))
        cell.compiled[key] = layer.to(cell.device, cell.dtype)
    return cell.compiled[key]


def _kept(cell: Cell, key: tuple, make: Callable[[], object]):
    if key not in cell.compiled:
        cell.compiled[key] = make()
    return cell.compiled[key]


def _autograd_case(
    call: Callable[[], Tensor], leaves: tuple[Tensor, ...], grad: Tensor, retain: bool = True, params: tuple = ()
) -> Case:
    """A differentiable call of `leaves`: backward is autograd's, on one forward kept alive
    (retain_graph=True). Compiled graphs may donate their saved buffers to the backward, which
    then runs once per forward: with retain=False the backward is timed as step minus forward.
    `params` get gradients too, as in training, but are not compared with the oracle."""
    wrt = (*leaves, *params)
    kept = [call()] if retain else []  # the forward backward() reuses

    def backward():
        if not kept:
            kept.append(call())
        return torch.autograd.grad(kept[0], wrt, grad, retain_graph=True)

    def step():
        return torch.autograd.grad(call(), wrt, grad)

    def results():
        fresh = call()
        return (fresh.detach(), *torch.autograd.grad(fresh, wrt, grad)[: len(leaves)])

    return Case(
        forward=call, backward=backward if retain else None, step=step, results=results, release=kept.clear
    )


# --- msda --------------------------------------------------------------------------------------


def _msda_op(cell: Cell) -> Case:
    args, grad = cell.inputs.args(), cell.grad_output

    def forward():
        return torch.ops.msda.forward(*args)

    def backward():
        return torch.ops.msda.backward(grad, *args)

    return Case(
        forward=forward,
        backward=backward,
        step=lambda: (forward(), backward()),
        results=lambda: (forward(), *backward()),
        capture_backward=True,
    )


def _around(case: Case, enter: Callable[[], Callable[[], None]]) -> Case:
    """`case` with `enter()` before each call and what it returns after (a setting on, then back)."""

    def wrapped(fn):
        def call():
            leave = enter()
            try:
                return fn()
            finally:
                leave()

        return call

    return replace(
        case, forward=wrapped(case.forward), backward=wrapped(case.backward), step=wrapped(case.step),
        results=wrapped(case.results),
    )  # fmt: skip


def _msda_deterministic(cell: Cell) -> Case:
    """_msda_op with torch.use_deterministic_algorithms(True) around each call: the backward's
    lists (and PyTorch's own deterministic-mode work, such as filling new tensors)."""

    def enter():
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        return lambda: torch.use_deterministic_algorithms(previous)

    return _around(_msda_op(cell), enter)


def _msda_no_shared_tile(cell: Cell) -> Case:
    """_msda_op with msda.kernels.launch.SHARED_TILE off around each call (MSDA_SHARED_TILE=0)."""
    from msda.kernels import launch

    def enter():
        previous, launch.SHARED_TILE = launch.SHARED_TILE, False
        return lambda: setattr(launch, "SHARED_TILE", previous)

    return _around(_msda_op(cell), enter)


def _msda_autograd(cell: Cell, starts_given: bool = True) -> Case:
    value, loc, attn = leaves = _op_leaves(cell)
    shapes = cell.inputs.spatial_shapes
    starts = cell.inputs.level_start_index if starts_given else None
    return _autograd_case(
        lambda: msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn), leaves, cell.grad_output
    )


def _msda_graph(cell: Cell) -> Case:
    args, grad = cell.inputs.args(), cell.grad_output
    value, loc, attn = leaves = _op_leaves(cell)
    shapes, starts = args[1], args[2]

    def forward_backward():
        out = msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
        return (out, *torch.autograd.grad(out, leaves, grad))

    forward_graph, forward_out = capture_graph(lambda: torch.ops.msda.forward(*args))
    step_graph, step_out = capture_graph(forward_backward)

    def forward():
        forward_graph.replay()
        return forward_out  # the static output, which each replay overwrites

    def step():
        step_graph.replay()
        return step_out

    def results():
        step()
        return tuple(t.detach().clone() for t in step_out)

    return Case(forward=forward, backward=None, step=step, results=results, capturable=False)


# --- Baselines ---------------------------------------------------------------------------------


def _reference(cell: Cell, compiled: bool = False) -> Case:
    value, loc, attn = leaves = _op_leaves(cell)
    shapes = [tuple(hw) for hw in cell.inputs.spatial_shapes.tolist()]
    fn = grid_sample_msda
    if compiled:
        backend = cell.compile_backend
        fn = _kept(cell, ("reference-compile", backend), lambda: torch.compile(fn, dynamic=True, backend=backend))
    return _autograd_case(lambda: fn(value, shapes, loc, attn), leaves, cell.grad_output, retain=not compiled)


def deformops_msda():
    """The peer's operator, torch.ops.deformops.msda (raises Unavailable without deformops)."""
    try:
        importlib.import_module("deformops.registry.msda")
        return torch.ops.deformops.msda
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"deformops is not importable: {e}") from e


def _deformops(cell: Cell) -> Case:
    op = deformops_msda()
    value, loc, attn = leaves = _op_leaves(cell)
    shapes, starts = cell.inputs.spatial_shapes, cell.inputs.level_start_index
    return _autograd_case(lambda: op(value, shapes, starts, loc, attn), leaves, cell.grad_output)


MMCV_IM2COL_STEP = 64  # mmcv's MultiScaleDeformableAttention default


def _mmcv(cell: Cell) -> Case:
    try:
        importlib.import_module("mmcv")
    except ImportError as e:
        raise Unavailable(f"mmcv is not installed: {e}") from e
    try:
        ext = importlib.import_module("mmcv._ext")
        forward_op, backward_op = ext.ms_deform_attn_forward, ext.ms_deform_attn_backward
    except (ImportError, AttributeError) as e:
        why = "mmcv has no compiled ms_deform_attn ops (mmcv-lite, or built for another torch)"
        raise Unavailable(f"{why}: {e}") from e
    args, grad = cell.inputs.args(), cell.grad_output
    value, _, _, loc, attn = args

    def forward():
        return forward_op(*args, im2col_step=MMCV_IM2COL_STEP)

    def backward():
        # What mmcv's autograd Function does: zeroed gradients, which the kernel accumulates into.
        grads = torch.zeros_like(value), torch.zeros_like(loc), torch.zeros_like(attn)
        backward_op(*args, grad.contiguous(), *grads, im2col_step=MMCV_IM2COL_STEP)
        return grads

    return Case(
        forward=forward,
        backward=backward,
        step=lambda: (forward(), backward()),
        results=lambda: (forward(), *backward()),
        capture_backward=True,
    )


# --- The Deformable DETR block -----------------------------------------------------------------


def _block(cell: Cell, mode: str | None = None, fused_softmax: bool = True) -> Case:
    """The layer eager, or compiled in `mode`; with its softmax fused into the operator (as
    users get it) or separate (fused_softmax=False, the original layer's). Its backward also
    computes the parameters' gradients, as a training step does (and as a compiled backward
    does in any case)."""
    layer = _layer(cell, fused_softmax)
    flat, ref, query = leaves = _block_leaves(cell)
    params = tuple(layer.parameters())
    shapes, starts = cell.inputs.spatial_shapes, cell.inputs.level_start_index
    if mode is None:
        return _autograd_case(lambda: layer(query, ref, flat, shapes, starts), leaves, cell.grad_output, params=params)

    s, backend = cell.shape, cell.compile_backend
    key = ("block-" + mode, cell.dtype, s.heads, s.head_dim, len(s.levels), s.points, backend, fused_softmax)
    if mode == "default":
        module = _kept(cell, key, lambda: torch.compile(layer, dynamic=True, backend=backend))
        call = lambda: module(query, ref, flat, shapes, starts)  # noqa: E731
        return _autograd_case(call, leaves, cell.grad_output, retain=False, params=params)

    if backend != "inductor":
        raise Unavailable(f"mode='reduce-overhead' is inductor's; the compile backend is {backend}")
    module = _kept(cell, key, lambda: torch.compile(layer, dynamic=True, mode="reduce-overhead"))
    wrt = (*leaves, *params)

    def forward():
        # Each call starts a new step of CUDA-graph trees (whose outputs a later replay overwrites).
        torch.compiler.cudagraph_mark_step_begin()
        return module(query, ref, flat, shapes, starts)

    def results():
        out = forward()
        kept = out.detach().clone()
        grads = torch.autograd.grad(out, wrt, cell.grad_output)[: len(leaves)]
        return (kept, *(g.clone() for g in grads))

    return Case(
        forward=forward,
        backward=None,  # backward only right after its forward: timed as step minus forward
        step=lambda: torch.autograd.grad(forward(), wrt, cell.grad_output),
        results=results,
        capturable=False,
    )


def _block_deformops(cell: Cell) -> Case:
    """The eager layer with deformops' fused softmax operator (torch.ops.deformops.msda_softmax,
    its method="softmax") in place of msda's: the same projections and parameters, the peer's
    kernels for the softmax and the sampling."""
    try:
        importlib.import_module("deformops.registry.msda")
        peer_op = torch.ops.deformops.msda_softmax
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"deformops is not importable, or has no msda_softmax: {e}") from e

    def core(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
        return peer_op(value, spatial_shapes, level_start_index, sampling_locations, attention_logits)

    # The layer's own forward, its one call of the softmax operator bound to the peer's: the
    # function with a copy of msda.layer's globals (no patching around each timed call).
    layer_forward = msda.layer.MultiScaleDeformableAttention.forward
    forward = types.FunctionType(
        layer_forward.__code__,
        {**vars(msda.layer), "multi_scale_deformable_attention_softmax": core},
        layer_forward.__name__,
        layer_forward.__defaults__,
    )
    layer = _layer(cell)
    flat, ref, query = leaves = _block_leaves(cell)
    shapes, starts = cell.inputs.spatial_shapes, cell.inputs.level_start_index
    return _autograd_case(
        lambda: forward(layer, query, ref, flat, shapes, starts), leaves, cell.grad_output,
        params=tuple(layer.parameters()),
    )  # fmt: skip


VARIANTS = (
    Variant("msda", "op", False, "torch.ops.msda.forward / torch.ops.msda.backward, called directly", _msda_op),
    Variant(
        "msda-deterministic",
        "op",
        False,
        "torch.ops.msda.forward / backward under torch.use_deterministic_algorithms(True): the "
        "backward's lists, bitwise run to run",
        _msda_deterministic,
    ),
    Variant(
        "msda-no-shared-tile",
        "op",
        False,
        "torch.ops.msda.forward / backward with MSDA_SHARED_TILE=0: a float32 encoder's last level added "
        "by atomics like the rest (on Hopper; the same as msda elsewhere)",
        _msda_no_shared_tile,
    ),
    Variant(
        "msda-autograd",
        "op",
        False,
        "msda.multi_scale_deformable_attention, the backward through autograd",
        _msda_autograd,
    ),
    Variant(
        "msda-autograd-no-starts",
        "op",
        False,
        "msda-autograd with level_start_index=None (the kernels sum the level sizes themselves)",
        lambda cell: _msda_autograd(cell, starts_given=False),
    ),
    Variant(
        "msda-graph",
        "op",
        False,
        "manually captured CUDA graphs of the forward and of forward+backward, replayed",
        _msda_graph,
        needs_cuda=True,
    ),
    Variant(
        "reference",
        "op",
        True,
        "pure PyTorch as model code writes it (F.grid_sample per level), eager",
        _reference,
    ),
    Variant(
        "reference-compile",
        "op",
        True,
        "the pure-PyTorch reference under torch.compile(dynamic=True)",
        lambda cell: _reference(cell, compiled=True),
    ),
    Variant(
        "deformops", "op", True, "peer: torch.ops.deformops.msda, its default backend", _deformops, peer="deformops"
    ),
    Variant("mmcv", "op", True, "peer: mmcv's ext_module.ms_deform_attn_forward/backward", _mmcv, peer="mmcv"),
    Variant(
        "block",
        "block",
        False,
        "msda.MultiScaleDeformableAttention (Deformable DETR's MSDeformAttn), eager: its softmax fused "
        "into the operator (msda::forward_softmax), as users get it",
        _block,
    ),
    Variant(
        "block-unfused",
        "block",
        True,
        "the same layer with fused_softmax=False: a separate softmax, then msda::forward (the original "
        "layer's computation), eager",
        lambda cell: _block(cell, fused_softmax=False),
    ),
    Variant(
        "block-deformops",
        "block",
        True,
        "peer: the same layer with deformops' fused softmax operator (torch.ops.deformops.msda_softmax, "
        'method="softmax") in place of msda\'s, eager',
        _block_deformops,
        peer="deformops",
    ),
    Variant(
        "block-compile",
        "block",
        False,
        "the block under torch.compile(dynamic=True)",
        lambda cell: _block(cell, "default"),
    ),
    Variant(
        "block-unfused-compile",
        "block",
        False,
        "block-unfused under torch.compile(dynamic=True) (Inductor compiles its separate softmax)",
        lambda cell: _block(cell, "default", fused_softmax=False),
    ),
    Variant(
        "block-reduce-overhead",
        "block",
        False,
        "the block under torch.compile(dynamic=True, mode='reduce-overhead')",
        lambda cell: _block(cell, "reduce-overhead"),
        needs_cuda=True,
    ),
)
PEERS = tuple(dict.fromkeys(v.peer for v in VARIANTS if v.peer))  # --peers names: deformops, mmcv
