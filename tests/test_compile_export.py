"""torch.compile and torch.export of the operator and of its softmax form on CPU (the pure-PyTorch
path in their bodies)."""

import pytest
import torch
import torch._dynamo.testing

import msda
from msda.testing import Shape, make_inputs, relative_error

pytestmark = pytest.mark.compile

FUNCTIONS = {
    "plain": (msda.multi_scale_deformable_attention, torch.ops.msda.forward.default),
    "softmax": (msda.multi_scale_deformable_attention_softmax, torch.ops.msda.forward_softmax.default),
}

# First batch 3: dynamo gives equal sizes one symbol, so a batch of 2 (the xy dim, and here the
# level count) would be specialized when the operator fixes L. M, D, K avoid 3 and 5 likewise.
# B*Q*M*D stays above 4096, where Inductor's CPU code generator guards a reduction size.
IMAGE_SIZES = [
    (3, ((24, 30), (12, 15)), 60),
    (5, ((20, 26), (10, 13)), 56),
    (3, ((32, 36), (16, 18)), 50),
]


def loss_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    out = msda.multi_scale_deformable_attention(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    return weighted_sum(out)


def softmax_loss_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_logits):
    out = msda.multi_scale_deformable_attention_softmax(
        value, spatial_shapes, level_start_index, sampling_locations, attention_logits
    )
    return weighted_sum(out)


def weighted_sum(out):
    """A scalar loss with uneven weights, so that no gradient is constant by symmetry, summed in
    float64: its terms cancel (their magnitudes add up to ~1,000x the sum's at the first image
    size), and a float32 sum's rounding, which Inductor's and eager's reduction orders make differ
    from one CPU to the next, would come out at that scale (1.7e-5 relative on an AMD EPYC host
    where the operator's own outputs and gradients were equal bit for bit)."""
    return (out.double() * torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)).sum()


def loss_and_grads(fn, inputs):
    """The loss and its gradients; the backward of a compiled fn is AOTAutograd's compiled one."""
    leaves = (inputs.value, inputs.sampling_locations, inputs.attention_weights)
    wrt = [t.detach().clone().requires_grad_() for t in leaves]
    loss = fn(wrt[0], inputs.spatial_shapes, inputs.level_start_index, wrt[1], wrt[2])
    loss.backward()
    return [loss] + [t.grad for t in wrt]


@pytest.mark.parametrize("softmax", [False, True], ids=["plain", "softmax"])
def test_compile_one_frame_across_image_sizes(softmax):
    fn = softmax_loss_fn if softmax else loss_fn
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for batch, levels, queries in IMAGE_SIZES:
        shape = Shape(batch=batch, queries=queries, heads=4, head_dim=8, levels=levels, points=4)
        inputs = make_inputs(shape, torch.float32, outside_fraction=0.1, seed=batch + queries, logits=softmax)
        for got, expected in zip(loss_and_grads(compiled, inputs), loss_and_grads(fn, inputs)):
            assert relative_error(got, expected) <= 1e-5
    assert counter.frame_count == 1


class Attention(torch.nn.Module):
    def __init__(self, kind="plain"):
        super().__init__()
        self.fn = FUNCTIONS[kind][0]

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return self.fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


@pytest.mark.parametrize("kind", FUNCTIONS)
def test_export_keeps_one_operator_node(tmp_path, kind):
    shape = Shape(batch=3, queries=7, heads=4, head_dim=8, levels=((6, 5), (3, 3)), points=4)
    inputs = make_inputs(shape, torch.float32, seed=41, logits=kind == "softmax")
    batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
    dynamic_shapes = (
        {0: batch},
        None,
        None,
        {0: batch, 1: queries},
        {0: batch, 1: queries},
    )
    program = torch.export.export(Attention(kind), inputs.args(), dynamic_shapes=dynamic_shapes)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    msda_targets = [t for t in targets if getattr(t, "namespace", None) == "msda"]
    assert msda_targets == [FUNCTIONS[kind][1]], targets

    path = tmp_path / "msda.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    other = make_inputs(Shape(5, 11, 4, 8, ((6, 5), (3, 3)), 4), torch.float32, seed=42, logits=kind == "softmax")
    assert relative_error(loaded(*other.args()), Attention(kind)(*other.args())) == 0.0
