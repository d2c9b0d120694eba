"""GPU tier of issue 15, item 1: the opt-in data checks on CUDA (docs/correctness.md). With
MSDA_VALIDATE=1 or inside msda.validate(), a CUDA call with bad level data raises the ValueError
the same call gets on CPU, eager and compiled, forward and backward; without, it runs (the
kernels stay in bounds: tests/gpu/test_gpu_bad_input.py) and nothing syncs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import msda
from msda import validation

from ..test_bad_input import BAD_CALLS, ENTRY_POINTS, FORWARD_ARGS, call, valid_args
from ..test_edge_cases import backend

DATA_CASES = [case for case in BAD_CALLS if case.needs_data]
ROOT = Path(__file__).resolve().parents[2]


def cpu_error(case, entry) -> str:
    with pytest.raises(ValueError) as info:
        call(entry, case.edit(valid_args("cpu")))
    return str(info.value)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("case", DATA_CASES, ids=lambda case: case.id)
def test_validate_raises_the_cpu_error_on_cuda(case, path):
    args = case.edit(valid_args("cuda"))
    with backend(path):
        for entry in ENTRY_POINTS:
            expected = cpu_error(case, entry)
            with msda.validate(), pytest.raises(ValueError) as info:
                call(entry, args)
            assert str(info.value) == expected, entry
            call(entry, args)  # outside: runs, unchecked
            torch.cuda.synchronize()


def test_validation_off_does_not_synchronize():
    args = DATA_CASES[0].edit(valid_args("cuda"))
    call("functional", args)  # warm-up (kernel compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for entry in ENTRY_POINTS:
            call(entry, args)
        with msda.validate(), pytest.raises(RuntimeError, match="synchroniz"):
            call("forward", args)  # the check is one host sync, which this mode forbids
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_msda_validate_environment_variable_turns_it_on():
    script = (
        "import torch, msda\n"
        "from tests.test_bad_input import BAD_CALLS, call, valid_args\n"
        "case = [c for c in BAD_CALLS if c.needs_data][0]\n"
        "try:\n"
        "    call('functional', case.edit(valid_args('cuda')))\n"
        "except ValueError as error:\n"
        "    print('raised', error)\n"
    )
    env = {**os.environ, "MSDA_VALIDATE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("raised value has S = 17"), result.stdout


def _wired(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """What the functional form does before calling the operator (see the next test)."""
    level_start_index = validation.check_level_data_when_validating(value, spatial_shapes, level_start_index)
    return torch.ops.msda.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def _compiled_case(fn):
    good = valid_args("cuda")
    bad = DATA_CASES[0].edit(good)  # S = 17 against 16 rows of levels
    expected = cpu_error(DATA_CASES[0], "forward")
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    return compiled, good, bad, expected


def _args(args):
    return [args[name] for name in FORWARD_ARGS]


def test_compiled_check_runs_when_validating_and_toggling_recompiles():
    compiled, good, bad, expected = _compiled_case(_wired)
    compiled(*_args(bad))  # off: compiled without the check, runs
    with msda.validate():
        with pytest.raises(ValueError) as info:
            compiled(*_args(bad))  # on: recompiled with the check (torch.compile guards the setting)
        assert str(info.value) == expected
        torch.testing.assert_close(compiled(*_args(good)), torch.ops.msda.forward(*_args(good)))
    compiled(*_args(bad))  # off again: the first graph
    torch.cuda.synchronize()


def test_compiled_functional_form_checks_when_validating():
    compiled, good, bad, expected = _compiled_case(msda.multi_scale_deformable_attention)
    with msda.validate():
        with pytest.raises(ValueError) as info:
            compiled(*_args(bad))
        assert str(info.value) == expected
