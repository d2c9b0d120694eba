"""The registered schemas, as docs/contract.md writes them (an expecttest snapshot)."""

import expecttest
import torch

import msda  # noqa: F401


class TestSchemas(expecttest.TestCase):
    def test_forward_schema(self):
        self.assertExpectedInline(
            str(torch.ops.msda.forward.default._schema),
            """msda::forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights) -> Tensor""",  # noqa: E501
        )

    def test_backward_schema(self):
        self.assertExpectedInline(
            str(torch.ops.msda.backward.default._schema),
            """msda::backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights) -> (Tensor, Tensor, Tensor)""",  # noqa: E501
        )

    def test_forward_softmax_schema(self):
        self.assertExpectedInline(
            str(torch.ops.msda.forward_softmax.default._schema),
            """msda::forward_softmax(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_logits) -> Tensor""",  # noqa: E501
        )

    def test_backward_softmax_schema(self):
        self.assertExpectedInline(
            str(torch.ops.msda.backward_softmax.default._schema),
            """msda::backward_softmax(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, Tensor attention_logits) -> (Tensor, Tensor, Tensor)""",  # noqa: E501
        )
