"""Timers that follow docs/benchmarking.md.

- Device time, two ways that must agree within 10%: the sum of the CUDA events' durations
  (kernels, memsets, copies) that torch.profiler records per call, and CUDA-graph replay
  (N calls captured in one graph, replayed, timed with CUDA events, divided by N).
- End-to-end time per eager call: many calls enqueued back to back, one synchronize, divided.
- On a CPU: torch.utils.benchmark.Timer with an explicit thread count (median and IQR).

Every timer warms up first and reports the median and spread over repetitions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

AGREEMENT = 0.10  # profiler and graph-replay device times must agree this closely


@dataclass
class Timing:
    """Microseconds per call over repetitions."""

    samples_us: list[float] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def iqr_us(self) -> float:
        """Interquartile range (the spread printed beside the median)."""
        if len(self.samples_us) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples_us, n=4, method="inclusive")
        return q3 - q1

    def __str__(self) -> str:
        return f"{self.median_us:.1f} us (IQR {self.iqr_us:.1f})"


def device_events_us(events: Iterable) -> float:
    """Total duration of the device-side events (kernels, memsets, copies) in a profiler trace."""
    return sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)


def warm_up(fn: Callable[[], object], calls: int = 3) -> None:
    """Run `fn` a few times (JIT compilation, allocator growth), then wait for the device."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def profiler_device_time(fn: Callable[[], object], calls: int = 20, repeats: int = 5) -> Timing:
    """Per-call device time from torch.profiler's CUDA events."""
    from torch.profiler import ProfilerActivity, profile

    warm_up(fn)
    timing = Timing()
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        timing.samples_us.append(device_events_us(prof.events()) / calls)
    return timing


def capture_graph(fn: Callable[[], object], calls: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `calls` calls of `fn`, warmed up first on a side stream (as capture requires),
    and the static output of the last call, which every replay overwrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up(fn)
    torch.cuda.current_stream().wait_stream(stream)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    torch.cuda.synchronize()
    return graph, out


def graph_device_time(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> Timing:
    """Per-call device time from replaying `calls` captured calls in one CUDA graph."""
    graph, _ = capture_graph(fn, calls)
    graph.replay()
    torch.cuda.synchronize()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timing = Timing()
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        timing.samples_us.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return timing


def end_to_end_time(fn: Callable[[], object], calls: int = 100, repeats: int = 5) -> Timing:
    """Per-call wall time of eager calls, dispatch included: enqueue `calls`, synchronize once."""
    warm_up(fn)
    timing = Timing()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        timing.samples_us.append((time.perf_counter() - t0) * 1e6 / calls)
    return timing


def cpu_time(fn: Callable[[], object], num_threads: int, min_run_time: float = 0.5) -> Timing:
    """CPU wall time per call via torch.utils.benchmark (it warms up itself)."""
    from torch.utils.benchmark import Timer

    measurement = Timer(stmt="fn()", globals={"fn": fn}, num_threads=num_threads).blocked_autorange(
        min_run_time=min_run_time
    )
    return Timing(samples_us=[t * 1e6 for t in measurement.times])


def agree(a_us: float, b_us: float, tolerance: float = AGREEMENT) -> bool:
    """Whether two device-time estimates agree within `tolerance` of the smaller."""
    return abs(a_us - b_us) <= tolerance * min(a_us, b_us)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated during one call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
