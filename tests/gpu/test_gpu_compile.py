"""GPU tier: a Deformable-DETR-style block (msda.MultiScaleDeformableAttention, LayerNorms, FFN)
under torch.compile(fullgraph=True, dynamic=True) on the Triton kernels: one graph, compiled on
the first call, serves three image sizes, two batch sizes and four query counts with no
recompilation (torch.compiler.set_stance("fail_on_recompile") after the first call); outputs and
gradients equal eager and the float64 oracle within the float32 bound of docs/contract.md. The body is shared
with the CPU tier (tests/detr_block.py), which runs it on the pure-PyTorch path. Both forms of the
layer: the softmax fused into the operator (msda::forward_softmax, the default) and not."""

import pytest

from ..detr_block import check_one_graph_for_all_sizes

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("fused_softmax", [True, False], ids=["fused-softmax", "unfused"])
def test_block_compiles_to_one_graph_for_all_image_sizes(fused_softmax):
    check_one_graph_for_all_sizes("cuda", fused_softmax)
