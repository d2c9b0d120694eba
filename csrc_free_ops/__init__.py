"""Drop-ins for the compiled extensions of the Deformable DETR family, backed by msda.

Existing model code runs unchanged, with no C++/CUDA compiler:

    import csrc_free_ops
    csrc_free_ops.install()                   # Deformable DETR, DINO: `import MultiScaleDeformableAttention`
    csrc_free_ops.mmcv.patch()                # mmcv / mmdet: MultiScaleDeformableAttention on every device
    csrc_free_ops.transformers.patch(model)   # Hugging Face transformers models
"""

from __future__ import annotations

import sys
from types import ModuleType

from . import extension as MultiScaleDeformableAttention
from . import mmcv, transformers

__all__ = ["MultiScaleDeformableAttention", "install", "mmcv", "transformers"]


def install() -> ModuleType:
    """Make `import MultiScaleDeformableAttention` give msda's drop-in (replacing any compiled one).

    Call it before the model code imports the extension (Deformable DETR's `models/ops`);
    returns the module.
    """
    sys.modules["MultiScaleDeformableAttention"] = MultiScaleDeformableAttention
    return MultiScaleDeformableAttention
