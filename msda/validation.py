"""Argument checks of the bad-input contract (docs/contract.md, "Bad input").

Every check here reads only metadata (rank, sizes, dtype, device, layout), so it costs no host
synchronization and runs unchanged on fake tensors while tracing. The data-dependent checks
(non-empty levels, S = sum of H_l * W_l, level_start_index its running sum) run only in eager
mode on CPU tensors; elsewhere the kernels mask every access to stay inside `value`.

spatial_shapes and level_start_index may be int64 or int32: the torch path and the kernels
both convert them to their own index type.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
    if _is_eager_cpu(value, spatial_shapes, level_start_index):
        _check_levels(S, spatial_shapes, level_start_index)


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


def _is_eager_cpu(*tensors: Tensor) -> bool:
    """True when reading tensor data is free: real CPU tensors, nothing tracing them."""
    if torch.compiler.is_compiling():
        return False
    # opcheck's and make_fx's tracing is not "compiling": look for fake tensors and a proxy mode.
    if any(torch._subclasses.fake_tensor.is_fake(t) or t.device.type != "cpu" for t in tensors):
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is None


def _check_levels(S: int, spatial_shapes: Tensor, level_start_index: Tensor) -> None:
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
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
