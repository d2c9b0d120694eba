"""GPU tier: a forward whose backward will run compiles that backward's kernels in a thread
(launch.compile_backward_ahead, kernels/ahead.py) under the keys the backward's launches look up,
so the backward compiles nothing more, through the eager fast path and through the operator, and
its gradients match the float64 oracle. (The shared tile's kernel: tests/gpu/test_gpu_shared_tile.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import msda
from msda import eager
from msda.kernels import ahead, launch
from msda.kernels.backward import msda_backward_kernel, msda_fold_replicas_kernel
from msda.testing import Shape, make_inputs

from ..helpers import assert_matches_reference, random_like_output

ROOT = Path(__file__).resolve().parents[2]

ENCODER_LEVELS = ((40, 40), (20, 20), (10, 10), (5, 5))  # 2,125 pixels: a float16 grad_value of 2**20 elements and more
CASES = {
    # A decoder: the backward kernel alone.
    "decoder float32": (
        Shape(batch=2, queries=50, heads=4, head_dim=32, levels=((12, 15), (6, 8), (3, 4)), points=4),
        torch.float32,
        [msda_backward_kernel],
    ),
    # A half-precision encoder: the backward kernel and the replicas' fold (backward.replica_rows).
    "encoder float16": (
        Shape(batch=2, queries=2125, heads=8, head_dim=32, levels=ENCODER_LEVELS, points=4),
        torch.float16,
        [msda_backward_kernel, msda_fold_replicas_kernel],
    ),
}


@pytest.mark.parametrize("route", ["fast-path", "operator"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_compiled_by_the_forward(case, route, monkeypatch):
    shape, dtype, kernels = CASES[case]
    # As in a new process: nothing compiled, nothing begun.
    monkeypatch.setattr(ahead, "_started", set())
    monkeypatch.setattr(launch, "_AHEAD_CALLS", set())
    for launcher in (eager._backward_kernel, eager._fold_kernel):
        monkeypatch.setattr(launcher, "compiled", {})
    for kernel in kernels:
        kernel.device_caches.clear()
    inputs = make_inputs(shape, dtype, "cuda", seed=94, outside_fraction=0.1)
    grad_output = random_like_output(inputs)
    value, shapes, starts, loc, attn = inputs.args()
    assert [kernel for kernel, *_ in launch.backward_launches(value, shapes, starts, loc, attn)] == kernels
    value, loc, attn = (t.detach().clone().requires_grad_() for t in (value, loc, attn))
    if route == "fast-path":
        out = msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    else:
        out = torch.ops.msda.forward(value, shapes, starts, loc, attn)
    for kernel in kernels:
        ahead.wait(kernel)
    caches = [kernel.device_caches[value.device.index][0] for kernel in kernels]
    assert [len(cache) for cache in caches] == [1] * len(kernels)  # compiled by the threads, before any backward
    grads = torch.autograd.grad(out, (value, loc, attn), grad_output)
    assert [len(cache) for cache in caches] == [1] * len(kernels)  # the backward's launches compiled nothing
    assert_matches_reference(inputs, (out.detach(), *grads), grad_output)


def test_nothing_begun_without_grad_or_in_deterministic_mode(monkeypatch):
    """No thread where no backward will run (no input requires grad) or where it runs other
    kernels (the deterministic mode's lists)."""
    shape, dtype, _ = CASES["decoder float32"]
    monkeypatch.setattr(launch, "_AHEAD_CALLS", set())
    started = []
    monkeypatch.setattr(ahead, "start", lambda *args: started.append(args))
    inputs = make_inputs(shape, dtype, "cuda", seed=95)
    msda.multi_scale_deformable_attention(*inputs.args())
    value, shapes, starts, loc, attn = inputs.args()
    value = value.detach().clone().requires_grad_()
    with torch.no_grad():
        msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    torch.use_deterministic_algorithms(True)
    try:
        msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    finally:
        torch.use_deterministic_algorithms(False)
    assert started == []
    msda.multi_scale_deformable_attention(value, shapes, starts, loc, attn)
    assert [args[0] for args in started] == [msda_backward_kernel]


# A process may end while the forward's thread still compiles: a script that runs one forward with
# grad and exits, or a forward's thread begun just before an exception ends the program. The
# process must exit cleanly (as a daemon, the thread once aborted it: kernels/ahead.py), and the
# Triton cache it leaves must serve the next process right.
_EXIT_SCRIPT = f"""
import sys, threading, torch, msda
from msda.kernels import launch
from msda.testing import Shape, make_inputs
from tests.helpers import assert_matches_reference, random_like_output
shape = Shape(batch=2, queries=2125, heads=8, head_dim=32, levels={ENCODER_LEVELS!r}, points=4)
inputs = make_inputs(shape, torch.float32, "cuda", seed=96, outside_fraction=0.1)
value, shapes, starts, loc, attn = inputs.args()
leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
if sys.argv[1] == "begun":  # exit while the thread compiles
    launch.compile_backward_ahead(value, shapes, starts, loc, attn)
    print("compiling at exit:", any(t.name == "msda-compile-ahead" for t in threading.enumerate()))
elif sys.argv[1] == "forward":  # exit after one forward with grad, no backward
    msda.multi_scale_deformable_attention(leaves[0], shapes, starts, leaves[1], leaves[2])
    torch.cuda.synchronize()
else:  # a later process on the cache those left: its gradients against the oracle
    grad_output = random_like_output(inputs)
    out = msda.multi_scale_deformable_attention(leaves[0], shapes, starts, leaves[1], leaves[2])
    assert_matches_reference(inputs, (out.detach(), *torch.autograd.grad(out, leaves, grad_output)), grad_output)
    print("gradients match")
"""


@pytest.mark.parametrize("ending", ["begun", "forward"])
def test_a_process_ending_while_the_thread_compiles_exits_cleanly(ending, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "triton")}

    def run(mode):
        result = subprocess.run(
            [sys.executable, "-c", _EXIT_SCRIPT, mode], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "Fatal" not in result.stderr, result.stderr[-3000:]
        return result.stdout

    out = run(ending)
    if ending == "begun":  # (an empty cache: the shared tile's kernel alone takes over a second)
        assert "compiling at exit: True" in out, out
    # The process waited for the thread: the backward's kernel is in the cache it left.
    assert any((tmp_path / "triton").rglob("msda_backward_kernel.cubin"))
    assert "gradients match" in run("check")
