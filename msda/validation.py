"""Argument checks of the bad-input contract (docs/contract.md, "Bad input").

`check_forward_args` / `check_backward_args` read metadata (rank, sizes, dtype, device, layout):
no host synchronization, and they run unchanged on fake tensors while tracing. The checks that
read the data of `spatial_shapes` and `level_start_index` (non-empty levels, S = sum of H_l * W_l,
level_start_index its running sum) run where the data is real, with the same message:

- CPU tensors: always. In eager mode `check_forward_args` reads them; under tracing (torch.compile,
  make_fx) `check_level_data` puts the small operator `msda::check_levels` into the graph, which
  reads them when the graph runs.
- CUDA tensors: only while validation is on (`MSDA_VALIDATE=1`, or `msda.validate()`), as each
  check costs one host synchronization, which CUDA-graph capture forbids and which stalls the
  launch queue. Eager calls check in `check_forward_args`; compiled ones where the functional
  form calls `check_level_data_when_validating`. Off, the kernels mask every access to stay
  inside `value` whatever the indices say.

spatial_shapes and level_start_index may be int64 or int32: the torch path and the kernels
both convert them to their own index type.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor


def _validate_from_environment() -> bool:
    setting = os.environ.get("MSDA_VALIDATE", "0").strip().lower()
    if setting not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"MSDA_VALIDATE must be 1 (check CUDA calls' level data) or 0, got {setting!r}")
    return setting in ("1", "true", "on")


# Whether CUDA calls check the level data (one host sync each): MSDA_VALIDATE, then msda.validate().
_VALIDATE = _validate_from_environment()

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

# Each argument's rank, how its dims read, and the dtypes it may have.
_LAYOUTS = {
    "value": (4, "(B, S, M, D)", FLOAT_DTYPES),
    "spatial_shapes": (2, "(L, 2)", INDEX_DTYPES),
    "level_start_index": (1, "(L,)", INDEX_DTYPES),
    "sampling_locations": (6, "(B, Q, M, L, K, 2)", FLOAT_DTYPES),
    "attention_weights": (5, "(B, Q, M, L, K)", FLOAT_DTYPES),
    "attention_logits": (5, "(B, Q, M, L, K)", FLOAT_DTYPES),  # the softmax operators' weights
    "grad_output": (3, "(B, Q, M * D)", FLOAT_DTYPES),
}


def check_tensor(name: str, t: object) -> Tensor:
    """Argument `name` is a dense tensor of its dtype kind and rank (static metadata only)."""
    rank, dims, dtypes = _LAYOUTS[name]
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {layout} tensor")
    if t.dtype not in dtypes:
        kind = "a floating" if dtypes is FLOAT_DTYPES else "an integer"
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have {kind} dtype ({names}), got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {dims}, got shape {tuple(t.shape)}")
    return t


def check_operator_args(weights_name: str, **named: object) -> None:
    """`check_tensor` for each argument by name (`attention` under `weights_name`: the attention
    weights, or the softmax form's logits), before a call of torch.ops.msda.*: their dispatcher
    rejects a non-tensor (a list, a nested tensor) with its own RuntimeError or
    NotImplementedError before the operator's checks run, where the compiled extensions that the
    drop-ins replace raised a TypeError."""
    for name, t in named.items():
        check_tensor(weights_name if name == "attention" else name, t)


def _expect_size(name: str, t: Tensor, dim: int, expected: int, what: str, source: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name} has {t.shape[dim]} {what} (dim {dim} of shape {tuple(t.shape)}), "
            f"expected {expected} as in {source}"
        )


def check_forward_args(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    weights_name: str = "attention_weights",
) -> None:
    """Raise TypeError/ValueError naming the argument for any call outside the contract.

    `weights_name` is the last argument's name in messages: "attention_logits" for the softmax
    operators, which take logits there (same shape and dtypes)."""
    check_tensor("value", value)
    check_tensor("spatial_shapes", spatial_shapes)
    check_tensor("level_start_index", level_start_index)
    check_tensor("sampling_locations", sampling_locations)
    check_tensor(weights_name, attention_weights)

    B, S, M, D = value.shape
    L = spatial_shapes.shape[0]
    if spatial_shapes.shape[1] != 2:
        raise ValueError(f"spatial_shapes must be (L, 2) rows of (H, W), got shape {tuple(spatial_shapes.shape)}")
    if L == 0:
        raise ValueError("spatial_shapes must describe at least one level, got L = 0")
    if M == 0:
        raise ValueError(f"value must have at least one head (M, dim 2), got shape {tuple(value.shape)}")
    if D == 0:
        raise ValueError(f"value must have a head dim D (dim 3) of at least 1, got shape {tuple(value.shape)}")
    _expect_size("level_start_index", level_start_index, 0, L, "levels", "spatial_shapes")

    loc, attn = sampling_locations, attention_weights
    _expect_size("sampling_locations", loc, 0, B, "batch entries", "value")
    _expect_size("sampling_locations", loc, 2, M, "heads", "value")
    _expect_size("sampling_locations", loc, 3, L, "levels", "spatial_shapes")
    if loc.shape[5] != 2:
        raise ValueError(f"sampling_locations must end in a dim of 2 (x, y), got shape {tuple(loc.shape)}")
    if loc.shape[4] == 0:
        raise ValueError(
            f"sampling_locations must have at least one point per level (K, dim 4), got shape {tuple(loc.shape)}"
        )
    Q, K = loc.shape[1], loc.shape[4]
    expected = [
        (B, "batch entries", "value"),
        (Q, "queries", "sampling_locations"),
        (M, "heads", "value"),
        (L, "levels", "spatial_shapes"),
        (K, "points", "sampling_locations"),
    ]
    for dim, (size, what, source) in enumerate(expected):
        _expect_size(weights_name, attn, dim, size, what, source)

    _check_same_device(
        value=value,
        spatial_shapes=spatial_shapes,
        level_start_index=level_start_index,
        sampling_locations=sampling_locations,
        **{weights_name: attention_weights},
    )
    if _checks_data(value.device) and _is_eager(value, spatial_shapes, level_start_index):
        _check_levels(S, spatial_shapes, level_start_index)


def weights_name(softmax: bool) -> str:
    """The name errors give the last tensor: the softmax operators take logits."""
    return "attention_logits" if softmax else "attention_weights"


def check_backward_args(
    grad_output: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    weights_name: str = "attention_weights",
) -> None:
    check_forward_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, weights_name)
    check_tensor("grad_output", grad_output)
    B, _, M, D = value.shape
    Q = sampling_locations.shape[1]
    expected = (B, Q, M * D)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have the output's shape {expected}, got {tuple(grad_output.shape)}")
    _check_same_device(value=value, grad_output=grad_output)


def _check_same_device(**tensors: Tensor) -> None:
    """Every tensor on the device of the first (`value`: cuda:1 is not cuda:0)."""
    (first, device), *others = ((name, t.device) for name, t in tensors.items())
    for name, other in others:
        if other != device:
            raise ValueError(f"{name} is on {other} but {first} is on {device}: all tensors must be on one device")


def _is_eager(*tensors: Tensor) -> bool:
    """True when the tensors hold real data and nothing traces them."""
    if torch.compiler.is_compiling():
        return False
    # opcheck's and make_fx's tracing is not "compiling": look for fake tensors and a proxy mode.
    if any(torch._subclasses.fake_tensor.is_fake(t) for t in tensors):
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is None


def untraced() -> bool:
    """Nothing compiling or tracing, no dispatch mode, torch.func transform or forward-mode AD:
    an eager call may skip the operator (msda/eager.py, msda/eager_cpu.py). `_is_eager`'s
    question in a few attribute reads, for the fast paths."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
        and forward_ad._current_level < 0
    )


def _is_eager_cpu(*tensors: Tensor) -> bool:
    """True when reading tensor data is free: real CPU tensors, nothing tracing them."""
    return all(t.device.type == "cpu" for t in tensors) and _is_eager(*tensors)


def _checks_data(device: torch.device) -> bool:
    """Whether calls on `device` check the level data: CPU always, CUDA while validation is on."""
    return device.type == "cpu" or (device.type == "cuda" and _VALIDATE)


def _check_levels(S: int, spatial_shapes: Tensor, level_start_index: Tensor) -> None:
    # One host transfer of both tensors (one synchronization on CUDA).
    L = spatial_shapes.shape[0]
    both = torch.cat([spatial_shapes.reshape(-1).to(torch.int64), level_start_index.to(torch.int64)]).tolist()
    shapes = [both[2 * level : 2 * level + 2] for level in range(L)]
    starts = both[2 * L :]
    for level, (h, w) in enumerate(shapes):
        if h <= 0 or w <= 0:
            raise ValueError(f"spatial_shapes[{level}] = ({h}, {w}): every level must be non-empty (H, W >= 1)")
    sizes = [h * w for h, w in shapes]
    if sum(sizes) != S:
        raise ValueError(
            f"value has S = {S} rows (dim 1), expected sum(H_l * W_l) = {sum(sizes)} from spatial_shapes {shapes}"
        )
    expected_starts = [sum(sizes[:level]) for level in range(len(sizes))]
    if starts != expected_starts:
        raise ValueError(
            f"level_start_index must be the running sum of H_l * W_l, {expected_starts}, got {starts}"
        )


# ---------------------------------------------------------------------------------------------
# The data checks at run time: the switch for CUDA, and the operator that carries them into
# compiled graphs.


def enabled() -> bool:
    """Whether CUDA calls check the level data (`MSDA_VALIDATE=1` or inside `msda.validate()`)."""
    return _VALIDATE


class validate(contextlib.ContextDecorator):
    """Check the level data of CUDA calls too: S = sum(H_l * W_l), non-empty levels and
    `level_start_index` the running sum, with the error a CPU call gets; eager or compiled,
    forward and backward. Each check costs one host synchronization, which is why it is off by
    default (CUDA-graph capture forbids it). A context manager and a decorator; `validate(False)`
    turns it off inside. `MSDA_VALIDATE=1` turns it on for the process. The setting is global
    (not per thread). torch.compile guards on it: a function compiled through the functional
    form (or the layer) recompiles when it changes. (A compiled call of `torch.ops.msda.forward`
    itself on CUDA is not checked; CPU calls always are.)

        with msda.validate():
            loss = model(images)
    """

    def __init__(self, enable: bool = True):
        self.enable = bool(enable)
        self._previous: list[bool] = []

    def __enter__(self) -> "validate":
        global _VALIDATE
        self._previous.append(_VALIDATE)
        _VALIDATE = self.enable
        return self

    def __exit__(self, *exc) -> None:
        global _VALIDATE
        _VALIDATE = self._previous.pop()


def check_level_data(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor) -> Tensor:
    """For the operator's body: returns `level_start_index`, on CPU while the body is traced
    (torch.compile, make_fx) through `msda::check_levels`, so that the compiled graph checks the
    data when it runs. In eager mode `check_forward_args` has read the data already; on CUDA a
    traced body adds no check (`check_level_data_when_validating` does, where torch.compile
    sees the setting)."""
    if value.device.type != "cpu" or _is_eager(value, spatial_shapes, level_start_index):
        return level_start_index
    return torch.ops.msda.check_levels(value.shape[1], spatial_shapes, level_start_index)


def check_level_data_when_validating(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor) -> Tensor:
    """For the Python around the operator that torch.compile traces (the functional form, before
    it calls the operator): returns `level_start_index`, on CUDA while validation is on and
    torch.compile traces through `msda::check_levels`.

    It lives there, not in the operator's body, for two reasons: torch.compile guards on the
    setting only where it traces Python (so that `msda.validate()` recompiles), and its cache of
    compiled graphs is keyed on the graph it traced, which then contains the check or not (the
    body's Python is not part of the key: a setting read there would let a cached graph traced
    with the other setting be reused). In eager mode `check_forward_args` checks."""
    if value.device.type != "cuda" or not enabled() or _is_eager(value, spatial_shapes, level_start_index):
        return level_start_index
    return torch.ops.msda.check_levels(value.shape[1], spatial_shapes, level_start_index)


# Not a triton_op: Inductor keeps this one opaque and calls it when the graph runs, on real
# tensors. It returns a copy of level_start_index that the operator then reads, so no pass
# removes it as dead code, and the kernels cannot run before it has checked.
@torch.library.custom_op("msda::check_levels", mutates_args=())
def _check_levels_op(num_values: int, spatial_shapes: Tensor, level_start_index: Tensor) -> Tensor:
    _check_levels(num_values, spatial_shapes, level_start_index)
    return level_start_index.clone(memory_format=torch.contiguous_format)


@_check_levels_op.register_fake
def _check_levels_fake(num_values, spatial_shapes, level_start_index):
    return torch.empty_like(level_start_index, memory_format=torch.contiguous_format)


def reject_forward_ad(op: str) -> None:
    """Raise where `torch.ops.msda.<op>` is called with forward-mode AD in effect: the operator
    has no forward-AD formula, and PyTorch would otherwise drop the tangents and return zeros.

    Forward AD is in effect when a dual level is open (torch.autograd.forward_ad.dual_level, which
    torch.func.jvp and jacfwd open too) and forward gradients are enabled (an autograd.Function's
    forward and jvp run with them disabled, so an operator called from there passes). Whether
    the inputs carry tangents cannot be seen here under torch.func (they arrive unwrapped), so a
    call on tangent-free inputs inside a dual level raises too.
    """
    if forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled():
        raise RuntimeError(
            f"msda: torch.ops.msda.{op} has no forward-mode AD formula and was called with "
            "forward-mode AD in effect (torch.func.jvp, torch.func.jacfwd, torch.func.hessian or "
            "torch.autograd.forward_ad), where it would return zero tangents: call it outside "
            "forward-mode AD, or from an autograd.Function whose jvp uses msda.derivatives.forward_jvp"
        )
