"""Hugging Face transformers: swap the `MultiScaleDeformableAttention` kernel layer for msda.

Deformable DETR, Grounding DINO, RT-DETR, OmDet-Turbo and the other transformers models that
use deformable attention hold an instance of a parameterless layer named
`MultiScaleDeformableAttention` (one class per model file, the same forward everywhere; the hub
`kernels` package may replace its forward). `patch(model)` replaces those instances. transformers
itself is not imported here: the layers are recognised by class name and defining package.
"""

from __future__ import annotations

from torch import Tensor, nn

from msda import multi_scale_deformable_attention

LAYER_NAME = "MultiScaleDeformableAttention"
# transformers' own models, and remote-code models (trust_remote_code) that copy the layer.
_PACKAGES = ("transformers.", "transformers_modules.")


class MultiScaleDeformableAttention(nn.Module):
    """msda-backed stand-in for transformers' kernel layer: the same forward, no parameters."""

    def forward(
        self,
        value: Tensor,
        value_spatial_shapes: Tensor,
        value_spatial_shapes_list: list[tuple[int, int]],
        level_start_index: Tensor | None,
        sampling_locations: Tensor,
        attention_weights: Tensor,
        im2col_step: int = 64,
    ) -> Tensor:
        # The shapes tensor is what msda reads (no host sync); the Python list and im2col_step
        # are only needed by transformers' pure-PyTorch path and the old compiled kernel.
        return multi_scale_deformable_attention(
            value, value_spatial_shapes, level_start_index, sampling_locations, attention_weights
        )


def _is_transformers_layer(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == LAYER_NAME and cls.__module__.startswith(_PACKAGES)


def patch(model: nn.Module, strict: bool = True) -> int:
    """Replace every transformers `MultiScaleDeformableAttention` layer in `model` with msda's.

    Returns how many were replaced. With `strict` (the default) a model with none of them
    raises ValueError, as patching the wrong object would otherwise pass silently.
    """
    if _is_transformers_layer(model):
        raise TypeError(f"patch the model that holds the {LAYER_NAME} layer, not the layer itself")
    targets = [(name, module) for name, module in model.named_modules() if _is_transformers_layer(module)]
    for name, module in targets:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, MultiScaleDeformableAttention().train(module.training))
    if strict and not targets:
        already = sum(isinstance(module, MultiScaleDeformableAttention) for module in model.modules())
        raise ValueError(
            f"found no transformers {LAYER_NAME} layer in {type(model).__name__} "
            f"({already} already patched); pass strict=False to allow this"
        )
    return len(targets)
