"""The CPU preset (python -m bench.cpu): Deformable DETR's level sizes, its grid_sample formulation
against the float64 oracle, its chunked oracle against the whole one, and a tiny run end to end
(every variant and pass, markdown written, msda within float32's bound), the markdown of a run
stopped midway, and the allocator settled before timing."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import cpu
from msda.testing import DETR_LEVELS, Inputs, Shape, make_inputs, reference, reference_with_grads, relative_error


def test_detr_levels_of_an_image():
    assert cpu.detr_levels(800, 1333) == DETR_LEVELS
    assert cpu.detr_levels(400, 667) == ((50, 84), (25, 42), (13, 21), (7, 11))


def test_grid_sample_formulation_matches_the_oracle_in_float64():
    inputs = make_inputs(Shape(2, 7, 3, 4, ((5, 6), (3, 3)), 2), torch.float64, outside_fraction=0.2, seed=3)
    levels = [tuple(level) for level in inputs.spatial_shapes.tolist()]
    got = cpu.grid_sample_msda(inputs.value, levels, inputs.sampling_locations, inputs.attention_weights)
    expected = reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights)
    assert relative_error(got, expected) < 1e-12


def test_chunked_oracle_equals_the_whole_oracle():
    inputs = make_inputs(Shape(2, 9, 2, 4, ((4, 5), (2, 3)), 2), torch.float32, seed=4)
    grad_output = torch.randn(2, 9, 8)
    whole = reference_with_grads(inputs, grad_output)
    chunked = cpu.oracle(Inputs(*inputs.args()), grad_output, queries_per_chunk=4)
    for got, expected in zip(chunked, whole):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "cpu.md"
    cpu.main(["--threads", "1", "--images", "64x96", "--batches", "1,2", "--min-reps", "2", "--max-reps", "2",
              "--budget", "0", "--compile-backend", "aot_eager", "--out", str(out)])
    text = out.read_text()
    assert "## 1 thread: median ± IQR ms per call" in text and "## accuracy" in text
    assert "Incomplete" not in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 64x96")]
    timing = [row for row in rows if row[4] in cpu.PASSES]
    accuracy = [row for row in rows if row[4] in cpu.VARIANTS]
    assert len(timing) == 2 * 2 * 2  # roles x batches x passes
    assert all(field.endswith("×") for row in timing for field in (row[7], row[10].rstrip(" |")))
    assert len(accuracy) == 2 * 2 * 4  # roles x batches x variants
    msda_rows = [row for row in accuracy if row[4].startswith("msda")]
    assert all(float(field.rstrip(" |")) <= 1e-5 for row in msda_rows for field in row[5:])


def test_a_stopped_run_keeps_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "cpu.md"
    calls = []

    def stop_after_two_rows(*args):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return original(*args)

    original = cpu.round_robin
    monkeypatch.setattr(cpu, "round_robin", stop_after_two_rows)
    try:
        cpu.main(["--threads", "1", "--images", "64x96", "--roles", "decoder", "--min-reps", "1", "--max-reps", "1",
                  "--budget", "0", "--no-compile", "--out", str(out)])
    except KeyboardInterrupt:
        pass
    text = out.read_text()
    assert "Incomplete" in text
    assert len([line for line in text.splitlines() if line.startswith("| 64x96") and "forward" in line]) == 2


# A call's temporaries, 12 MiB held at once and then freed, eight times over after two warm-ups:
# the page faults they take, in a new process, with or without bench.cpu's settle_allocator first.
_FAULTS_OF_CALLS = """
import resource, sys, torch
from bench import cpu
def call():
    held = [torch.empty(3 * 2**18).fill_(1.0) for _ in range(4)]
    del held
if sys.argv[1] == "settled":
    cpu.settle_allocator()
call(); call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    call()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_settled_allocator_keeps_a_calls_temporaries_mapped():
    """After settle_allocator, a call's temporaries are not faulted in again at every call: under
    a tenth of the 24,576 pages that eight calls write. (A new process without it took 24,320
    faults on this repo's CPU machine, but one CI run's took 768, for a reason not found: a new
    process does not always start unsettled, so only the settled side is asserted.)"""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}

    def faults(state: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FAULTS_OF_CALLS, state], cwd=root, env=env,
                             capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    pages = 8 * 4 * 3 * 2**18 * 4 // 4096
    assert faults("settled") < pages / 10, f"unsettled here: {faults('plain')} faults"
