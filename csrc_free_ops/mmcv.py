"""mmcv / mmdet: mmcv's multi-scale deformable attention on msda, with or without mmcv's compiled ops.

mmcv's `MultiScaleDeformableAttention` module (what mmdet's Deformable DETR, DINO and their
relatives build) calls `MultiScaleDeformableAttnFunction.apply`, which calls
`ext_module.ms_deform_attn_forward/backward`, on CUDA, and `multi_scale_deformable_attn_pytorch`
elsewhere. `patch()` replaces all three in `mmcv.ops.multi_scale_deform_attn`, so the module
runs msda on every device. mmcv-lite ships the Python code of `mmcv.ops` but not the compiled
`mmcv._ext` it imports (and an mmcv built for another torch fails to load it); `patch()` then
stands one in, whose other ops raise a clear error.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from torch import Tensor

from msda import eager, multi_scale_deformable_attention

from .extension import ms_deform_attn_forward

TARGET = "mmcv.ops.multi_scale_deform_attn"


class MultiScaleDeformableAttnFunction:
    """mmcv's autograd Function, on msda: `apply(value, value_spatial_shapes,
    value_level_start_index, sampling_locations, attention_weights, im2col_step)`.

    msda's functional form carries its own autograd (and takes msda's eager fast paths), so
    `apply` is a plain call; `im2col_step` is ignored. Mixed precision needs no cast: the output
    has value's dtype, each gradient its input's.
    """

    @staticmethod
    def apply(
        value: Tensor,
        value_spatial_shapes: Tensor,
        value_level_start_index: Tensor,
        sampling_locations: Tensor,
        attention_weights: Tensor,
        im2col_step: int = 64,
    ) -> Tensor:
        return multi_scale_deformable_attention(
            value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
        )


def multi_scale_deformable_attn_pytorch(
    value: Tensor, value_spatial_shapes: Tensor, sampling_locations: Tensor, attention_weights: Tensor
) -> Tensor:
    """mmcv's CPU fallback, on msda (which computes the level start index on device)."""
    if not isinstance(value_spatial_shapes, Tensor):  # some callers pass a list of (H, W)
        value_spatial_shapes = torch.as_tensor(value_spatial_shapes, dtype=torch.int64, device=value.device)
    return multi_scale_deformable_attention(value, value_spatial_shapes, None, sampling_locations, attention_weights)


def ms_deform_attn_backward(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_loc: Tensor,
    attn_weight: Tensor,
    grad_output: Tensor,
    grad_value: Tensor,
    grad_sampling_loc: Tensor,
    grad_attn_weight: Tensor,
    im2col_step: int = 64,
) -> None:
    """mmcv's `ext_module` backward: writes into the three zero-initialised gradient tensors."""
    grads = eager.backward(grad_output, value, spatial_shapes, level_start_index, sampling_loc, attn_weight)
    for out, grad in zip((grad_value, grad_sampling_loc, grad_attn_weight), grads):
        out.copy_(grad)


# What `mmcv.ops.multi_scale_deform_attn.ext_module` holds after patch(): mmcv's forward has the
# Deformable DETR extension's signature; its backward writes in place instead of returning.
ext_module = SimpleNamespace(
    ms_deform_attn_forward=ms_deform_attn_forward, ms_deform_attn_backward=ms_deform_attn_backward
)


def patch() -> ModuleType:
    """Route mmcv's (or mmcv-lite's) MultiScaleDeformableAttention to msda on every device.

    Call it before importing model code that copies these names out of mmcv
    (`from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction`); mmcv's own
    module looks them up at call time. Returns the patched mmcv module.
    """
    try:
        import mmcv  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "csrc_free_ops.mmcv.patch() patches mmcv, which is not installed: "
            "pip install mmcv-lite (no compiled ops needed) or mmcv"
        ) from error
    target = _import_target()
    target.MultiScaleDeformableAttnFunction = MultiScaleDeformableAttnFunction
    target.multi_scale_deformable_attn_pytorch = multi_scale_deformable_attn_pytorch
    target.ext_module = ext_module
    ops = sys.modules["mmcv.ops"]
    for name in ("MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch"):
        if hasattr(ops, name):  # re-exported by mmcv.ops
            setattr(ops, name, getattr(target, name))
    return target


def _import_target() -> ModuleType:
    try:
        return importlib.import_module(TARGET)
    except ImportError as error:
        if not _is_compiled_ops_failure(error):
            raise
    sys.modules["mmcv._ext"] = _MissingExtension("mmcv._ext")
    return importlib.import_module(TARGET)


def _is_compiled_ops_failure(error: ImportError) -> bool:
    """mmcv._ext missing (mmcv-lite; name "mmcv._ext"), or present but not loadable (built for
    another torch; the loader names it "_ext" and gives its path)."""
    if error.name == "mmcv._ext":
        return True
    return error.name == "_ext" and error.path is not None and "mmcv" in Path(error.path).parts


class _MissingExtension(ModuleType):
    """Stands in for mmcv's compiled `_ext` so that `mmcv.ops` imports; only MSDA works.

    Its `__spec__` has no loader: `importlib.util.find_spec("mmcv._ext")` answers (a module in
    sys.modules without a spec makes it raise ValueError, which broke mmengine's
    `mmcv_full_available()` inside mmdet's `init_detector`), and `pkgutil.find_loader` finds no
    loader, so mmengine truthfully sees no full mmcv (compiled ops) installed.
    """

    ms_deform_attn_forward = staticmethod(ms_deform_attn_forward)
    ms_deform_attn_backward = staticmethod(ms_deform_attn_backward)

    def __init__(self, name: str):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # keep import machinery probes (__path__, __file__) truthful
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"mmcv op {name!r} needs mmcv's compiled ops (mmcv-lite has none); "
                "csrc_free_ops provides only multi-scale deformable attention"
            )

        return unavailable
