"""Bad input (docs/contract.md, "Bad input"): every invalid call raises a ValueError or TypeError whose
message names the argument and says what was expected, before any kernel runs.

BAD_CALLS is the battery: each case edits a valid set of arguments into an invalid one. It runs
through the three entry points (the functional form, torch.ops.msda.forward, torch.ops.msda.backward)
on both backends; tests/gpu/test_gpu_bad_input.py runs the same list on CUDA.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import msda
from msda import ops
from msda.testing import Shape, make_inputs

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


def call(entry: str, args: dict):
    """Call one entry point with `args` (forward arguments by name, plus grad_output)."""
    forward_args = [args[name] for name in FORWARD_ARGS]
    if entry == "functional":
        return msda.multi_scale_deformable_attention(*forward_args)
    if entry == "forward":
        return torch.ops.msda.forward(*forward_args)
    if entry == "backward":
        return torch.ops.msda.backward(args["grad_output"], *forward_args)
    raise ValueError(entry)


def entry_points(case: BadCall) -> list[str]:
    """The entry points that promise a ValueError/TypeError for `case`."""
    return [e for e in case.entries if e == "functional" or not case.dispatcher_rejects]


def assert_rejects(case: BadCall, entry: str, args: dict) -> None:
    """The call raises case.error with a message naming case.argument and what was expected."""
    with pytest.raises((ValueError, TypeError)) as info:
        call(entry, case.edit(args))
    message = str(info.value)
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {message}"
    assert re.search(rf"\b{case.argument}\b", message), f"message does not name {case.argument}: {message}"
    assert re.search(r"\b(must|expected)\b", message), f"message does not say what was expected: {message}"


BATTERY = [
    pytest.param(case, entry, id=f"{entry}-{case.id}")
    for case in BAD_CALLS
    for entry in entry_points(case)
]

# The checks run before the backend branch; both backends are covered all the same. On CPU the
# Triton path is the interpreter (tests/gpu covers the compiled kernels).
INTERPRETER = ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)] if INTERPRETER else ["torch"]


@pytest.fixture(params=BACKENDS)
def each_backend(request, monkeypatch):
    monkeypatch.setattr(ops, "BACKEND", request.param)
    return request.param


def test_battery_ids_are_unique():
    ids = [case.id for case in BAD_CALLS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case,entry", BATTERY)
def test_bad_call_raises_naming_the_argument(case, entry, each_backend):
    assert_rejects(case, entry, valid_args())


@pytest.mark.parametrize("case", [c for c in BAD_CALLS if c.dispatcher_rejects], ids=lambda c: c.id)
def test_operator_dispatcher_rejects_non_tensors(case):
    """torch.ops.msda.* parse their arguments against the schema before the operator runs: a
    list or scalar fails there with PyTorch's own error (a RuntimeError naming the argument),
    a nested tensor finds no kernel (NotImplementedError). Only the functional form promises a
    TypeError for these; this test pins down that nothing worse happens."""
    args = case.edit(valid_args())
    for entry in set(case.entries) & set(OPERATORS):
        with pytest.raises((TypeError, RuntimeError, NotImplementedError)):
            call(entry, args)


@pytest.mark.parametrize(
    "spatial_shapes",
    [[[3, 4], [2, 2]], torch.tensor([[3.0, 4.0]]), torch.tensor([3, 4, 2, 2]), torch.tensor([[3, 4]]).to_sparse()],
    ids=["list", "float", "1d", "sparse"],
)
def test_functional_without_level_start_index_checks_spatial_shapes(spatial_shapes):
    """level_start_index=None: the functional form computes it from spatial_shapes, checked first."""
    args = {**valid_args(), "spatial_shapes": spatial_shapes, "level_start_index": None}
    with pytest.raises((TypeError, ValueError), match="spatial_shapes"):
        call("functional", args)


@pytest.mark.parametrize("shapes_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("starts_dtype", [torch.int32, torch.int64])
def test_int32_shapes_and_starts_are_accepted(shapes_dtype, starts_dtype, each_backend):
    """int32 spatial_shapes / level_start_index (what some exporters produce) are valid input."""
    args = valid_args()
    expected = call("functional", args)
    args["spatial_shapes"] = args["spatial_shapes"].to(shapes_dtype)
    args["level_start_index"] = args["level_start_index"].to(starts_dtype)
    for entry in ENTRY_POINTS:
        call(entry, args)
    torch.testing.assert_close(call("functional", args), expected)


def test_all_meta_is_valid():
    """Tensors all on "meta" are one device: the fake implementation answers with the shape."""
    args = {name: t.to("meta") for name, t in valid_args().items()}
    assert call("forward", args).shape == (2, 3, 8)
    assert [g.shape for g in call("backward", args)] == [(2, 16, 2, 4), (2, 3, 2, 2, 2, 2), (2, 3, 2, 2, 2)]


def test_bad_call_fails_the_same_under_tracing():
    """The fake implementations run the metadata checks, so a bad call fails while tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = valid_args()
    args["attention_weights"] = args["attention_weights"][:, :2]
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) for name, t in args.items()}
        with pytest.raises(ValueError, match="attention_weights"):
            call("forward", fake)
