"""Both kernels compile for sm_90 (Hopper) with the installed triton, at the launch configurations
the operator picks (scripts/compile_check.py, in a subprocess: under TRITON_INTERPRET the kernels
are interpreted and cannot be compiled). Triton's compiler has crashed on tile shapes in one
release and not another; CI installs the oldest triton the test group declares (3.6.0), the
release the GPU tier ran on."""

import os
import subprocess
import sys
from pathlib import Path

from msda.kernels.forward import forward_launch_config

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "kernels compiled for sm_90" in result.stdout


def test_float64_forward_runs_one_query_per_program():
    """The rule that keeps triton 3.6 compiling float64 (gradcheck) tiles."""
    assert forward_launch_config(4, 4, 32, 8, float64=True)["BLOCK_Q"] == 1
    assert forward_launch_config(4, 4, 32, 4, float64=True)["BLOCK_LK"] == 1  # float32 values, float64 locations


def test_forward_gathers_16_bytes_per_thread():
    """The forward's tile: one 16-byte load per thread per corner, whatever the value dtype."""
    for element_size, queries in ((4, 16), (2, 32)):
        config = forward_launch_config(4, 4, 32, element_size)
        assert (config["BLOCK_Q"], config["BLOCK_LK"], config["num_warps"]) == (queries, 1, 4)
        assert config["BLOCK_Q"] * config["BLOCK_LK"] * config["BLOCK_D"] * element_size == 16 * 32 * 4
