"""msda: multi-scale deformable attention for PyTorch, in Triton, as a registered operator.

    import msda
    out = msda.multi_scale_deformable_attention(value, spatial_shapes, None, locations, weights)
    out = msda.multi_scale_deformable_attention_softmax(value, spatial_shapes, None, locations, logits)

Importing msda registers torch.ops.msda.forward and torch.ops.msda.backward, and their softmax
forms torch.ops.msda.forward_softmax and torch.ops.msda.backward_softmax.
"""

from . import ops  # noqa: F401  (registers torch.ops.msda.*)
from .functional import (
    level_start_index_from_shapes,
    multi_scale_deformable_attention,
    multi_scale_deformable_attention_softmax,
)
from .layer import MultiScaleDeformableAttention
from .validation import validate

__version__ = "0.1.0"

__all__ = [
    "multi_scale_deformable_attention",
    "multi_scale_deformable_attention_softmax",
    "level_start_index_from_shapes",
    "MultiScaleDeformableAttention",
    "validate",
    "__version__",
]
