"""Session 54: the eager forward's host time on the installed triton, piece by piece, to compare
3.6's C launcher with 3.7/3.8's tuple form (entry 106 saw 3.8's forwards dearer across runs of
a host whose speed moved 1.5x). Decoder preset, float32, no grad: host us a call, the median of
15 blocks of 200 calls with a synchronize a block, each piece measured twice in turn.

"C launch alone" replays the forward's prepared launch with the arguments it was last given
(the C function on 3.6, the closure over it on 3.7/3.8); "empty.add_(1)" is the floor of any
eager op on the host, against which the other rows compare across processes. Run once per
release in turn, in separate processes, e.g. (triton 3.8 unpacked in /tmp/t38x):
    PYTHONPATH=/tmp/t38x:. python3 bench/results/sweeps/session54-c_launch_alone.py
    PYTHONPATH=. python3 bench/results/sweeps/session54-c_launch_alone.py"""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
import msda  # noqa: E402
from msda import eager  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

value, shapes, starts, loc, attn = make_inputs(PRESETS["decoder"], torch.float32, "cuda", dist="uniform", seed=3).args()


def forward_no_grad():
    with torch.no_grad():
        msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)


for _ in range(5):
    forward_no_grad()
torch.cuda.synchronize()

# The prepared launch's arguments, captured at one call through a wrapper, then put back.
key, prepared = next((k, v) for k, v in eager._forward_launches.items() if v is not None)
captured = []
eager._forward_launches[key] = prepared._replace(launch=lambda *a: captured.append(a) or prepared.launch(*a))
eager.launch_forward(value, shapes, starts, loc, attn)
eager._forward_launches[key] = prepared
assert captured, "the forward did not take its prepared launch"


def c_launch_alone():
    prepared.launch(*captured[0])


def host_us(fn, calls=200, blocks=15):
    times = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


empty = torch.empty(1, device="cuda")
pieces = {
    "empty.add_(1)": lambda: empty.add_(1),
    "C launch alone": c_launch_alone,
    "eager.launch_forward": lambda: eager.launch_forward(value, shapes, starts, loc, attn),
    "forward no grad": forward_no_grad,
}
result = {}
for _ in range(2):  # the second measurement of each piece is the one kept
    result = {name: round(host_us(fn), 2) for name, fn in pieces.items()}
print(triton.__version__, result, "launch", prepared.launch, flush=True)
