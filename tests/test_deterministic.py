"""Deterministic mode (docs/contract.md): under torch.use_deterministic_algorithms(True) the backward
takes the pure-PyTorch path, whose scatter is deterministic in that mode, on every backend. On
CPU that is checked through the Triton backend (the interpreter); tests/gpu checks on CUDA that
the gradients are bitwise equal run to run."""

from unittest import mock

import pytest
import torch

from msda import torch_impl
from msda.testing import Shape, make_inputs

from .helpers import assert_matches_reference, forward_backward, random_like_output
from .test_edge_cases import backend, needs_interpreter

pytestmark = needs_interpreter


@pytest.mark.parametrize("mode", ["default", "deterministic"])
def test_deterministic_mode_takes_the_pure_pytorch_backward(mode, request):
    if mode == "deterministic":
        request.getfixturevalue("deterministic_algorithms")
    inputs = make_inputs(Shape(1, 5, 2, 4, ((3, 4), (2, 2)), 2), seed=6)
    grad_output = random_like_output(inputs)
    with backend("triton"), mock.patch.object(torch_impl, "backward", wraps=torch_impl.backward) as spy:
        results = forward_backward(inputs, grad_output)
    assert spy.call_count == (1 if mode == "deterministic" else 0)
    assert_matches_reference(inputs, results, grad_output)
