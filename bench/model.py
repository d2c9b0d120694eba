"""A model of the operator for reading its times: the memory floor.

MSDA is memory-bound. Its floor is the time to read each input once and write each output once
at the copy bandwidth that this device achieves (measured once per run). `floor_fraction` is how
close a measured time comes to it: 1.0 is the floor, 0.1 is ten times slower than the floor.
"""

from __future__ import annotations

import statistics

import torch

from msda.testing import Shape

from .timing import cpu_time

COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # large enough to leave every cache behind


def min_bytes(shape: Shape, dtype: torch.dtype, loc_dtype: torch.dtype, pass_: str) -> int:
    """Bytes that one call must move at least: each input read once, each output written once.

    forward reads value, the locations, the weights, spatial_shapes and level_start_index and
    writes the output; backward reads grad_output and the forward's inputs and writes the three
    gradients (grad_value has value's shape, the other two their input's).
    """
    B, Q, M, D, L, K, S = (shape.batch, shape.queries, shape.heads, shape.head_dim, len(shape.levels),
                           shape.points, shape.num_values)
    size, loc_size = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=loc_dtype).element_size()
    value = B * S * M * D * size
    output = B * Q * M * D * size
    locations = B * Q * M * L * K * 2 * loc_size
    weights = B * Q * M * L * K * loc_size
    shapes = L * 2 * 8 + L * 8  # int64 spatial_shapes and level_start_index
    inputs = value + locations + weights + shapes
    if pass_ == "forward":
        return inputs + output
    if pass_ == "backward":
        return output + inputs + value + locations + weights  # grad_output in, three gradients out
    raise ValueError(f"pass_ must be 'forward' or 'backward', got {pass_!r}")


def copy_bandwidth(device: torch.device, num_threads: int = 1) -> float:
    """Bytes per second of one large copy on `device`, counting bytes read plus bytes written."""
    nbytes = COPY_BYTES[device.type]
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):
            dst.copy_(src)
        seconds = []
        for _ in range(10):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        seconds_per_copy = statistics.median(seconds)
    else:
        seconds_per_copy = cpu_time(lambda: dst.copy_(src), num_threads, min_run_time=0.2).median_us / 1e6
    return 2 * nbytes / seconds_per_copy


def floor_fraction(nbytes: int, bandwidth: float, time_us: float) -> float:
    """The memory floor's time (nbytes at `bandwidth`) over the measured time."""
    return nbytes / bandwidth * 1e6 / time_us
