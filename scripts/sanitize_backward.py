"""The backward kernel at the benchmark presets, for compute-sanitizer's racecheck (shared-memory
hazards) and initcheck (reads of global memory nothing wrote):

    compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \\
        python3 scripts/sanitize_backward.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --error-exitcode 1 \\
        python3 scripts/sanitize_backward.py

(Without PyTorch's caching allocator every tensor is its own allocation, so initcheck sees
exactly what was written into it.) Each preset (decoder, encoder) in each dtype: one backward
with a random grad_output and one with the expanded grad_output of `out.sum().backward()`, after
a forward. `--preset decoder` or `--dtype float32` narrow the run (on the H200 both tools
over every preset and dtype took 111 s in all; on an H100, racecheck over the encoder preset
alone took 151 s, a dtype a process). Prints one summary line; a Python error exits
nonzero, the sanitizer's findings exit with its --error-exitcode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from msda import ops  # noqa: E402
from msda.testing import PRESETS, make_inputs  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], default="all")
    args = parser.parse_args()
    device = torch.device("cuda")
    assert ops.uses_triton(device), "CUDA tensors must run the Triton kernels (is MSDA_BACKEND=torch set?)"
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]

    calls = 0
    for preset in presets:
        for name in dtypes:
            inputs = make_inputs(PRESETS[preset], DTYPES[name], device, outside_fraction=0.05, seed=calls)
            out = torch.ops.msda.forward(*inputs.args())
            gen = torch.Generator(device=device).manual_seed(calls)
            random = torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype)
            expanded = torch.ones((), device=device, dtype=out.dtype).expand(out.shape)
            for grad_output in (random, expanded):
                grads = torch.ops.msda.backward(grad_output, *inputs.args())
                torch.cuda.synchronize()
                assert all(torch.isfinite(g).all() for g in grads), f"{preset} {name}: non-finite gradient"
                calls += 1
    print(
        f"sanitize_backward: {calls} backward calls on {torch.cuda.get_device_name(device)} "
        f"(presets {', '.join(presets)} x dtypes {', '.join(dtypes)} x 2 grad_outputs, each after a forward)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
