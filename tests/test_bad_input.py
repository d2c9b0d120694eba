"""Bad input (docs/contract.md, "Bad input"): every invalid call raises a ValueError or TypeError whose
message names the argument and says what was expected, before any kernel runs.

The battery is msda.testing_cases.BAD_CALLS: each case edits a valid set of arguments into an
invalid one. It runs through the three entry points (the functional form, torch.ops.msda.forward,
torch.ops.msda.backward) on both backends; tests/gpu/test_gpu_bad_input.py runs the same list on CUDA.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import msda
from msda import ops
from msda.testing_cases import BAD_CALLS, ENTRY_POINTS, FORWARD_ARGS, OPERATORS, BadCall, valid_args


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
