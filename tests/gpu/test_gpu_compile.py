"""GPU tier: a Deformable-DETR-style block (msda.MultiScaleDeformableAttention, LayerNorms, FFN)
under torch.compile(fullgraph=True, dynamic=True) on the Triton kernels: one graph, compiled on
the first call, serves three image sizes, two batch sizes and four query counts with no
recompilation (torch.compiler.set_stance("fail_on_recompile") after the first call); outputs and
gradients equal eager and the float64 oracle within the float32 bound of docs/contract.md. The body is shared
with the CPU tier (tests/detr_block.py), which runs it on the pure-PyTorch path. Both forms of the
layer: the softmax fused into the operator (msda::forward_softmax, the default) and not.

And the half-precision backward on dense samples (native atomics, replicas of the dense levels and
their fold, bench/NOTES.md entry 33), which the block's float32 does not reach: one graph for two
image sizes, gradients within the float16 bound of the float64 oracle."""

import pytest
import torch
import torch._dynamo.testing

import msda
from msda.kernels import backward as backward_kernel
from msda.testing import TOLERANCE, Shape, make_inputs, reference_with_grads, relative_error

from ..detr_block import check_one_graph_for_all_sizes

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("fused_softmax", [True, False], ids=["fused-softmax", "unfused"])
def test_block_compiles_to_one_graph_for_all_image_sizes(fused_softmax):
    check_one_graph_for_all_sizes("cuda", fused_softmax)


def test_half_precision_replicas_compile_to_one_graph():
    """Encoder-like float16 calls (Q = S, 4 levels, 340 samples a pixel on the coarsest: replicas)
    at two image sizes under torch.compile(fullgraph=True, dynamic=True): one frame, and output
    and gradients within the float16 bound."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def loss_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, weight):
        out = msda.multi_scale_deformable_attention(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights
        )
        return (out * weight).sum()

    compiled = torch.compile(loss_fn, backend=counter, fullgraph=True, dynamic=True)
    for side in (64, 72):
        levels = tuple((side >> i, side >> i) for i in range(4))
        S = sum(h * w for h, w in levels)
        shape = Shape(batch=1, queries=S, heads=8, head_dim=32, levels=levels, points=4)
        inputs = make_inputs(shape, torch.float16, "cuda", dist="local", seed=side)
        assert backward_kernel.replica_rows(torch.float16, S, S, 4, 4) is not None
        assert backward_kernel.grad_value_accumulator_dtype(inputs.value, S, 4, 4) == torch.float16
        weight = torch.randn(1, S, 8 * 32, device="cuda").half()
        tensors = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
        wrt = [t.detach().clone().requires_grad_() for t in tensors]
        compiled(wrt[0], inputs.spatial_shapes, inputs.level_start_index, wrt[1], wrt[2], weight).backward()
        expected = reference_with_grads(inputs, weight)
        for name, got, ref in zip(("grad_value", "grad_loc", "grad_attn"), [t.grad for t in wrt], expected[1:]):
            error = relative_error(got, ref)
            assert error <= TOLERANCE[torch.float16], f"side {side}: {name} {error:.1e}"
    assert counter.frame_count == 1
