"""Case tables shared by the tests and the scripts (scripts/sanitize.py, scripts/compile_drift.py):
data, no assertions, so that a script never imports a test module.

- EDGE_CASES: calls that must work and match the float64 oracle (msda.testing.reference): empty
  batches and query sets, one level or one point, 1x1, 1x200 and 200x1 levels, head dims that are
  not powers of two and up to 256, 16 heads, non-contiguous arguments, an expanded grad_output,
  locations far outside [0, 1], NaN and +-inf locations, int32 shapes. Interpreter-sized.
- BAD_CALLS: the bad-input battery of docs/contract.md. Each case edits a valid set of arguments
  (valid_args) into an invalid one, and names the error and the argument its message must name.
- tiny_deformable_detr: a tiny randomly initialised Hugging Face transformers Deformable DETR (no
  download; needs transformers), with the training loss the drop-in tests compare.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .testing import Inputs, Shape, make_inputs

# --- Edge cases ----------------------------------------------------------------------------------

FAR = (-1e6, 1e6, -1e30, 1e30, -3.0, 5.0)  # float16 rounds the large ones to +-inf: also valid
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class EdgeCase:
    id: str
    shape: Shape
    outside_fraction: float = 0.0  # of the locations moved just outside [0, 1] (make_inputs)
    # Then a third of the coordinates replaced: "far" (FAR), "nonfinite" (NaN, +-inf), or
    # "edges" (all coordinates on 0, 1, pixel centres or pixel borders).
    special: str = ""
    views: bool = False  # every argument (and grad_output) a non-contiguous view
    expanded_grad: bool = False  # grad_output expanded from (1, 1, M * D): stride 0 along B and Q
    index_dtype: torch.dtype = torch.int64  # of spatial_shapes and level_start_index

    def build(self, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> tuple[Inputs, Tensor]:
        """The case's inputs on `device` and a grad_output for its backward."""
        inputs = make_inputs(self.shape, dtype, outside_fraction=self.outside_fraction, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        loc = _special_locations(inputs.sampling_locations, self.special, self.shape, gen)
        B, Q, M, D = self.shape.batch, self.shape.queries, self.shape.heads, self.shape.head_dim
        grad_shape = (1, 1, M * D) if self.expanded_grad else (B, Q, M * D)
        grad_output = torch.randn(grad_shape, generator=gen).to(device=device, dtype=dtype)
        if self.expanded_grad:
            grad_output = grad_output.expand(B, Q, M * D)
        elif self.views:
            grad_output = _spread(grad_output.transpose(0, 1)).transpose(0, 1)

        def place(t: Tensor, dt: torch.dtype, first_dims_swapped: bool = False) -> Tensor:
            t = t.to(device=device, dtype=dt)
            if not self.views:
                return t
            if first_dims_swapped:  # a (S, B, ...) buffer seen as (B, S, ...), as DETR code does
                return _spread(t.transpose(0, 1)).transpose(0, 1)
            return _spread(t)

        loc_dtype = inputs.sampling_locations.dtype
        inputs = Inputs(
            value=place(inputs.value, dtype, first_dims_swapped=True),
            spatial_shapes=place(inputs.spatial_shapes, self.index_dtype),
            level_start_index=place(inputs.level_start_index, self.index_dtype),
            sampling_locations=place(loc, loc_dtype),
            attention_weights=place(inputs.attention_weights, loc_dtype),
        )
        return inputs, grad_output


def _spread(t: Tensor) -> Tensor:
    """`t`'s values in a non-contiguous view: every other element of a buffer twice as wide."""
    buffer = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    view = buffer[..., ::2]
    view.copy_(t)
    return view


def _special_locations(loc: Tensor, special: str, shape: Shape, gen: torch.Generator) -> Tensor:
    if not special:
        return loc
    if special == "edges":
        # 0, 1, and per level the pixel borders i / W and centres (i + 0.5) / W (and likewise in y):
        # integer and half-integer pixel positions, where floor() and the bilinear weights are exact.
        sizes = torch.tensor(shape.levels, dtype=torch.float64).flip(1).view(1, 1, 1, -1, 1, 2)  # (W, H)
        steps = torch.randint(0, 2 * 7 + 1, loc.shape, generator=gen).to(torch.float64) / 2
        on_grid = (steps / sizes).clamp(0, 1)
        ends = torch.randint(0, 2, loc.shape, generator=gen).to(torch.float64)
        pick_end = torch.rand(loc.shape, generator=gen) < 0.2
        return torch.where(pick_end, ends, on_grid).to(loc.dtype)
    choices = {"far": FAR, "nonfinite": NON_FINITE}[special]
    replaced = torch.rand(loc.shape, generator=gen) < 1 / 3
    picks = torch.tensor(choices, dtype=torch.float64)[torch.randint(0, len(choices), loc.shape, generator=gen)]
    return torch.where(replaced, picks.to(loc.dtype), loc)


BASE = Shape(batch=2, queries=3, heads=2, head_dim=4, levels=((3, 4), (2, 2)), points=2)

# Interpreter-sized shapes: Triton's interpreter runs each program in NumPy, ~0.05 s apiece.
EDGE_CASES = [
    EdgeCase("empty-batch", dataclasses.replace(BASE, batch=0)),
    EdgeCase("empty-queries", dataclasses.replace(BASE, queries=0)),
    EdgeCase("empty-batch-and-queries", dataclasses.replace(BASE, batch=0, queries=0)),
    EdgeCase("one-level-one-point", Shape(2, 3, 2, 4, ((5, 6),), 1), outside_fraction=0.3),
    EdgeCase("one-point", dataclasses.replace(BASE, points=1), outside_fraction=0.3),
    EdgeCase("1x1-levels", Shape(2, 4, 2, 4, ((1, 1), (1, 1), (2, 1)), 3), outside_fraction=0.3),
    EdgeCase("1x1-only", Shape(1, 5, 1, 4, ((1, 1),), 1), outside_fraction=0.3),
    EdgeCase("1x1-edges", Shape(1, 5, 2, 4, ((1, 1), (1, 2)), 2), special="edges"),
    EdgeCase("wide-and-tall", Shape(1, 6, 2, 8, ((1, 200), (200, 1)), 2), outside_fraction=0.2),
    *[
        EdgeCase(f"head-dim-{d}", Shape(1, 3, 2, d, ((3, 4), (2, 2)), 2), outside_fraction=0.2)
        for d in (1, 3, 24, 48, 96)
    ],
    EdgeCase("head-dim-256", Shape(1, 3, 1, 256, ((3, 4), (2, 2)), 2), outside_fraction=0.2),
    EdgeCase("16-heads", Shape(1, 2, 16, 8, ((3, 4), (2, 2)), 2), outside_fraction=0.2),
    EdgeCase("query-blocks", Shape(1, 70, 1, 4, ((3, 4),), 2), outside_fraction=0.2),  # > one BLOCK_Q
    # 70 samples a pixel on the 1 x 2 level: the backward spreads them over replicas of its rows.
    EdgeCase("dense-level", Shape(2, 70, 2, 4, ((3, 4), (1, 2)), 2), outside_fraction=0.2),
    EdgeCase("non-contiguous", BASE, outside_fraction=0.3, views=True),
    EdgeCase("expanded-grad-output", BASE, outside_fraction=0.3, expanded_grad=True),
    EdgeCase("edges", BASE, special="edges"),
    EdgeCase("far-outside", BASE, special="far"),
    EdgeCase("non-finite", BASE, outside_fraction=0.3, special="nonfinite"),
    EdgeCase("int32-shapes", BASE, outside_fraction=0.3, index_dtype=torch.int32),
    EdgeCase(
        "all-at-once",
        Shape(2, 3, 3, 24, ((1, 1), (1, 9), (7, 1)), 3),
        outside_fraction=0.3,
        special="nonfinite",
        views=True,
        expanded_grad=True,
        index_dtype=torch.int32,
    ),
]


# --- Bad input -----------------------------------------------------------------------------------

# Valid arguments to edit: B=2, Q=3, M=2, D=4, levels (3, 4) and (2, 2) (S = 16), K=2.
SHAPE = Shape(batch=2, queries=3, heads=2, head_dim=4, levels=((3, 4), (2, 2)), points=2)
FORWARD_ARGS = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")
PER_LEVEL = FORWARD_ARGS[1:]
ENTRY_POINTS = ("functional", "forward", "backward")
OPERATORS = ("forward", "backward")


def valid_args(device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The forward arguments by name, plus a matching grad_output."""
    inputs = make_inputs(SHAPE, torch.float32, device)
    args = dict(zip(FORWARD_ARGS, inputs.args()))
    args["grad_output"] = torch.randn(2, 3, 8, device=device)
    return args


def elsewhere(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device: "meta" for a CPU tensor (no second device needed), CPU otherwise."""
    return t.to("meta" if t.device.type == "cpu" else "cpu")


@dataclass(frozen=True)
class BadCall:
    id: str
    edit: Callable[[dict], dict]  # valid arguments -> invalid ones
    error: type[Exception]
    argument: str  # the message must name it
    entries: tuple[str, ...] = ENTRY_POINTS  # where the call is invalid (grad_output: the backward)
    # A non-tensor (a list, a nested tensor): torch.ops' dispatcher rejects it before the
    # operator's checks run, so only the functional form can promise a TypeError.
    dispatcher_rejects: bool = False
    # Needs the data of spatial_shapes / level_start_index: checked on CPU in eager mode only
    # (no host sync on CUDA, where the kernels mask every access instead).
    needs_data: bool = False


def bad(argument: str, what: str, error: type[Exception], change: Callable | None = None, edit=None, **flags):
    """The case "{argument}-{what}": `change` applied to that argument, or a whole `edit` of the
    arguments (whose error must name `argument` too)."""
    if edit is None:
        edit = lambda a: {**a, argument: change(a[argument])}  # noqa: E731
    if argument == "grad_output":
        flags.setdefault("entries", ("backward",))
    return BadCall(f"{argument}-{what}", edit, error, argument, **flags)


def without_last_level(*names: str) -> Callable[[dict], dict]:
    """An edit dropping the last level of the per-level arguments `names`."""
    slicers = {
        "spatial_shapes": lambda t: t[:-1],
        "level_start_index": lambda t: t[:-1],
        "sampling_locations": lambda t: t[:, :, :, :-1],
        "attention_weights": lambda t: t[:, :, :, :-1],
    }
    return lambda a: {**a, **{name: slicers[name](a[name]) for name in names}}


def levels_differ_in(name: str) -> Callable[[dict], dict]:
    """One level less in every per-level argument but `name`."""
    return without_last_level(*(other for other in PER_LEVEL if other != name))


def with_shapes(levels, starts=None) -> Callable[[dict], dict]:
    """spatial_shapes set to `levels`, level_start_index to `starts` (default: the running sum)."""

    def edit(a: dict) -> dict:
        device = a["spatial_shapes"].device
        shapes = torch.tensor(levels, dtype=torch.int64, device=device)
        sizes = shapes.prod(1)
        start = sizes.cumsum(0) - sizes if starts is None else torch.tensor(starts, device=device)
        return {**a, "spatial_shapes": shapes, "level_start_index": start}

    return edit


def nested(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` as a nested tensor of its batch entries."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor(list(t.unbind(0)), layout=getattr(torch, layout))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


FLOATS_ONLY = (torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64)
INTEGERS_ONLY = (torch.float32, torch.float64, torch.float16, torch.int16, torch.uint8, torch.bool, torch.complex64)
# Slices that cut the named dim to a wrong size: (argument, dim name, slice).
WRONG_COUNTS = [
    ("value", "batch", lambda t: t[:1]),
    ("value", "heads", lambda t: t[:, :, :1]),
    ("sampling_locations", "batch", lambda t: t[:1]),
    ("sampling_locations", "queries", lambda t: t[:, :2]),
    ("sampling_locations", "heads", lambda t: t[:, :, :1]),
    ("sampling_locations", "points", lambda t: t[..., :1, :]),
    ("attention_weights", "batch", lambda t: torch.cat([t, t[:1]])),
    ("attention_weights", "queries", lambda t: t[:, :2]),
    ("attention_weights", "heads", lambda t: t[:, :, :1]),
    ("attention_weights", "points", lambda t: t[..., :1]),
]
NO_HEADS = {name: (lambda t: t[:, :, :0]) for name in ("value", "sampling_locations", "attention_weights")}
NO_LEVELS = {
    "value": lambda t: t[:, :0],
    "spatial_shapes": lambda t: t[:0],
    "level_start_index": lambda t: t[:0],
    "sampling_locations": lambda t: t[:, :, :, :0],
    "attention_weights": lambda t: t[:, :, :, :0],
}


def _apply(changes: dict) -> Callable[[dict], dict]:
    return lambda a: {**a, **{name: fn(a[name]) for name, fn in changes.items()}}


BAD_CALLS: list[BadCall] = [
    # Not a dense tensor.
    *[bad(name, "list", TypeError, lambda t: t.tolist(), dispatcher_rejects=True) for name in FORWARD_ARGS],
    *[bad(name, "numpy", TypeError, lambda t: t.cpu().numpy(), dispatcher_rejects=True) for name in FORWARD_ARGS],
    # None: the dispatcher passes it on as an undefined tensor. The functional form computes a
    # level_start_index of None; the operators need one.
    *[bad(name, "None", TypeError, lambda t: None) for name in FORWARD_ARGS if name != "level_start_index"],
    bad("level_start_index", "None", TypeError, lambda t: None, entries=OPERATORS),
    bad("value", "scalar", TypeError, lambda t: 1.0, dispatcher_rejects=True),
    *[bad(name, "sparse", TypeError, lambda t: t.to_sparse()) for name in FORWARD_ARGS],
    *[
        bad("value", f"nested-{layout}", TypeError, lambda t, layout=layout: nested(t, layout), dispatcher_rejects=True)
        for layout in ("strided", "jagged")
    ],
    # Integer, boolean or complex where floats are expected; floats where integers are.
    *[
        bad(name, _name(dtype), TypeError, lambda t, dtype=dtype: t.to(dtype))
        for name in ("value", "sampling_locations", "attention_weights")
        for dtype in FLOATS_ONLY
    ],
    bad("value", "complex128", TypeError, lambda t: t.to(torch.complex128)),
    *[
        bad(name, _name(dtype), TypeError, lambda t, dtype=dtype: t.to(dtype))
        for name in ("spatial_shapes", "level_start_index")
        for dtype in INTEGERS_ONLY
    ],
    # Wrong rank.
    bad("value", "3d", ValueError, lambda t: t.flatten(2)),
    bad("value", "5d", ValueError, lambda t: t[None]),
    bad("value", "0d", ValueError, lambda t: t.new_tensor(1.0)),
    bad("spatial_shapes", "1d", ValueError, lambda t: t.flatten()),
    bad("spatial_shapes", "3d", ValueError, lambda t: t[None]),
    bad("level_start_index", "2d", ValueError, lambda t: t[:, None]),
    bad("level_start_index", "0d", ValueError, lambda t: t[0]),
    bad("sampling_locations", "5d", ValueError, lambda t: t[..., 0]),
    bad("sampling_locations", "7d", ValueError, lambda t: t[None]),
    bad("attention_weights", "4d", ValueError, lambda t: t.flatten(3)),
    bad("attention_weights", "6d", ValueError, lambda t: t[..., None]),
    # Wrong size of a fixed dim.
    bad("spatial_shapes", "Lx3", ValueError, lambda t: t[:, [0, 1, 1]]),
    bad("spatial_shapes", "Lx1", ValueError, lambda t: t[:, :1]),
    bad("sampling_locations", "xyz", ValueError, lambda t: torch.cat([t, t[..., :1]], -1)),
    bad("sampling_locations", "x-only", ValueError, lambda t: t[..., :1]),
    # Level counts that differ between spatial_shapes, level_start_index and the samples.
    bad("level_start_index", "extra-level", ValueError, lambda t: torch.cat([t, t[-1:]])),
    *[
        bad(name, "levels", ValueError, edit=levels_differ_in(name))
        for name in PER_LEVEL
    ],
    # Batch, query, head and point counts that differ between arguments.
    *[bad(name, dim, ValueError, change) for name, dim, change in WRONG_COUNTS],
    # Zero heads, channels, points or levels.
    bad("value", "zero-heads", ValueError, edit=_apply(NO_HEADS)),
    bad("value", "zero-head-dim", ValueError, lambda t: t[..., :0]),
    bad(
        "sampling_locations",
        "zero-points",
        ValueError,
        edit=_apply({"sampling_locations": lambda t: t[:, :, :, :, :0], "attention_weights": lambda t: t[..., :0]}),
    ),
    bad("spatial_shapes", "zero-levels", ValueError, edit=_apply(NO_LEVELS)),
    # Tensors on different devices.
    *[bad(name, "other-device", ValueError, elsewhere) for name in (*FORWARD_ARGS, "grad_output")],
    # Data-dependent: S != sum(H * W), an empty level, inconsistent level_start_index.
    bad("value", "S-too-large", ValueError, lambda t: torch.randn(2, 17, 2, 4, device=t.device), needs_data=True),
    bad("value", "S-too-small", ValueError, lambda t: t[:, :15], needs_data=True),
    bad("value", "levels-sum-to-18", ValueError, edit=with_shapes([(3, 4), (2, 3)]), needs_data=True),
    bad("value", "levels-overflow", ValueError, edit=with_shapes([(2**32, 2**32), (2, 2)], [0, 12]), needs_data=True),
    bad("spatial_shapes", "empty-level", ValueError, edit=with_shapes([(4, 4), (0, 2)]), needs_data=True),
    bad("spatial_shapes", "zero-width", ValueError, edit=with_shapes([(3, 0), (4, 4)]), needs_data=True),
    bad("spatial_shapes", "negative", ValueError, edit=with_shapes([(-3, -4), (2, 2)], [0, 12]), needs_data=True),
    *[
        bad("level_start_index", what, ValueError, edit=with_shapes([(3, 4), (2, 2)], starts), needs_data=True)
        for what, starts in [("wrong", [0, 11]), ("offset", [4, 16]), ("negative", [-12, 0]), ("past-end", [0, 2**40])]
    ],
    # grad_output of the backward.
    *[bad("grad_output", _name(dtype), TypeError, lambda t, dtype=dtype: t.to(dtype)) for dtype in FLOATS_ONLY],
    bad("grad_output", "list", TypeError, lambda t: t.tolist(), dispatcher_rejects=True),
    bad("grad_output", "None", TypeError, lambda t: None),
    bad("grad_output", "sparse", TypeError, lambda t: t.to_sparse()),
    bad("grad_output", "4d", ValueError, lambda t: t.view(2, 3, 2, 4)),
    bad("grad_output", "2d", ValueError, lambda t: t.flatten(1)),
    bad("grad_output", "channels", ValueError, lambda t: t[..., :7]),
    bad("grad_output", "queries", ValueError, lambda t: t[:, :2]),
    bad("grad_output", "batch", ValueError, lambda t: torch.cat([t, t])),
    bad("grad_output", "transposed", ValueError, lambda t: t.transpose(0, 1)),
]


# --- A tiny transformers Deformable DETR ---------------------------------------------------------


def tiny_deformable_detr(seed: int = 0):
    """DeformableDetrModel with d_model 32 on a 4-stage ResNet of 8 to 32 channels: 4 levels
    (8x8, 4x4, 2x2, 1x1 for a 64x64 image), one encoder and one decoder layer, no dropout."""
    from transformers import DeformableDetrConfig, DeformableDetrModel, ResNetConfig

    backbone = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 16, 32],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    config = DeformableDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,  # older transformers default to a timm backbone
        use_pretrained_backbone=False,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_queries=10,
        num_feature_levels=4,
        encoder_n_points=2,
        decoder_n_points=2,
        dropout=0.0,
        disable_custom_kernels=True,  # the stock side is transformers' pure-PyTorch layer
    )
    torch.manual_seed(seed)
    model = DeformableDetrModel(config)
    # The grid init offsets whole pixels, so encoder samples land exactly on pixel centres: kinks
    # of bilinear interpolation, where the two paths' float rounding picks different one-sided
    # gradients. A trained model's offsets are off the lattice; so are these.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sampling_offsets.bias"):
                p.add_(torch.empty_like(p).uniform_(-0.4, 0.4))
    return model


def pixel_values(batch: int = 2, size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state")


def training_loss(model, pixels: torch.Tensor):
    """(loss, outputs): a fixed, uneven weighting of both outputs, which reaches every parameter.

    Both outputs leave a LayerNorm, whose sum and sum of squares are constant: such a loss has
    no gradient but rounding.
    """
    out = model(pixel_values=pixels)
    outputs = {key: out[key] for key in OUTPUTS}
    loss = sum((t.float() * _fixed_weights(t)).mean() for t in outputs.values())
    return loss, outputs


def _fixed_weights(t: torch.Tensor) -> torch.Tensor:
    """Deterministic weights in [-1, 1] of t's shape, made on its device (no generator to trace)."""
    return torch.arange(t.numel(), device=t.device).reshape(t.shape).float().mul(0.618).sin()


def outputs_and_grads(model, pixels: torch.Tensor):
    """(outputs, {parameter name: gradient}) of one eager training step."""
    loss, outputs = training_loss(model, pixels)
    loss.backward()
    return outputs, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def flat(grads: dict) -> torch.Tensor:
    """All gradients as one float32 vector. Some are zero but for rounding (biases before a
    GroupNorm, the 1x1 level's norm): compared alone their relative error means nothing."""
    return torch.cat([grads[name].flatten().float() for name in sorted(grads)])
