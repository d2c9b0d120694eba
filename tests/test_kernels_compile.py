"""Both kernels compile for sm_90 (Hopper) with the installed triton, at the launch configurations
the operator picks (scripts/compile_check.py, in a subprocess: under TRITON_INTERPRET the kernels
are interpreted and cannot be compiled). Triton's compiler has crashed on tile shapes in one
release and not another; CI installs the oldest triton the test group declares (3.6.0), the
release the GPU tier ran on."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from msda.kernels import launch

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "kernels compiled for sm_90" in result.stdout


def test_a_whole_row_per_load_instruction():
    """The default tiles read each gathered value row with one 16-byte load per thread, a whole
    row per warp instruction (the L1 serves a row in one wavefront; bench/NOTES.md entry 13)."""
    for config in (launch.forward_config(4, 4, 32, torch.float32), launch.backward_config(4, 4, 32, torch.float32)):
        for element_size in (4, 2):
            c = config.constexprs(32, element_size, 4)
            threads_per_row = c["CHUNK"] // (16 // element_size)
            assert threads_per_row * 16 == 32 * element_size and c["BLOCK_D"] == c["CHUNK"]
            assert c["num_warps"] * 32 == c["BLOCK_Q"] * c["GROUPS"] * threads_per_row


def test_programs_fit_the_thread_limit():
    """No launch setting asks for more than 512 threads a program, whatever the row width
    (D = 256 in float64 is 128 loads of 16 bytes; the hardware limit is 1024)."""
    for config in (launch.forward_config(4, 4, 32, torch.float32), launch.backward_config(4, 4, 32, torch.float32)):
        for head_dim in (1, 3, 8, 24, 32, 48, 64, 96, 256):
            for element_size in (2, 4, 8):
                for points in (1, 2, 4, 8):
                    c = config.constexprs(head_dim, element_size, points)
                    threads = c["BLOCK_Q"] * c["GROUPS"] * max(1, c["CHUNK"] // max(1, 16 // element_size))
                    assert c["num_warps"] * 32 <= 512 and threads <= 512, (head_dim, element_size, points, c)
