"""GPU tier: the operator follows the caller's stream and its tensors' device. On a non-default
CUDA stream its forward and backward are correct and their kernels run on that stream (seen in a
profile: the stream ids CUPTI reports for the kernels); with tensors on another GPU than the
current one, the kernels run on the tensors' GPU."""

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from msda.testing import PRESETS, make_inputs

from ..helpers import assert_matches_reference, forward_backward, random_like_output

SHAPE = PRESETS["decoder"]


def _kernels(prof, name: str) -> list:
    """The CUDA kernels of a profile whose name contains `name` (their device_resource_id is the
    stream id, their device_index the GPU)."""
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and name in e.name]


def test_forward_and_backward_run_on_the_current_stream():
    inputs = make_inputs(SHAPE, torch.float32, "cuda", seed=7)
    grad_output = random_like_output(inputs)
    forward_backward(inputs, grad_output)  # warm-up: the first call JIT-compiles the kernels

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000)  # a marker kernel (spin_kernel) on the default stream
        with torch.cuda.stream(side):
            results = forward_backward(inputs, grad_output)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    assert_matches_reference(inputs, results, grad_output)
    msda = _kernels(prof, "msda_")
    default_streams = {e.device_resource_id for e in _kernels(prof, "spin_kernel")}
    names = {e.name for e in msda}
    assert any("msda_forward" in n for n in names) and any("msda_backward" in n for n in names), names
    assert len(default_streams) == 1, default_streams
    streams = {e.device_resource_id for e in msda}
    assert len(streams) == 1 and streams.isdisjoint(default_streams), (streams, default_streams)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_kernels_run_on_the_tensors_device_not_the_current_one():
    inputs = make_inputs(SHAPE, torch.float32, "cuda:1", seed=8)
    grad_output = random_like_output(inputs)
    with torch.cuda.device(0):
        forward_backward(inputs, grad_output)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            results = forward_backward(inputs, grad_output)
            torch.cuda.synchronize(1)
    assert_matches_reference(inputs, results, grad_output)
    devices = {e.device_index for e in _kernels(prof, "msda_")}
    assert devices == {1}, devices
