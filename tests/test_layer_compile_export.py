"""msda.MultiScaleDeformableAttention in a Deformable-DETR-style block, on CPU (the operator's
pure-PyTorch path): torch.compile(fullgraph=True, dynamic=True) makes one graph for every image
size, batch size and query count, equal to eager and to the float64 oracle; torch.export keeps
the operator as one node with dynamic batch, queries and image size, and survives save / load.
The GPU tier runs the same checks on the Triton kernels (tests/gpu/test_gpu_compile.py,
tests/gpu/test_gpu_export.py)."""

import pytest

from .detr_block import check_export_round_trip, check_one_graph_for_all_sizes

pytestmark = pytest.mark.compile


def test_block_compiles_to_one_graph_for_all_image_sizes():
    check_one_graph_for_all_sizes("cpu")


@pytest.mark.parametrize("fused_softmax", [True, False], ids=["fused-softmax", "unfused"])
def test_block_exports_with_dynamic_batch_queries_and_image_size(tmp_path, fused_softmax):
    check_export_round_trip("cpu", tmp_path / "block.pt2", fused_softmax)
