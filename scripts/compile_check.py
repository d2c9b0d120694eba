"""Compile both kernels for sm_90 (Hopper) with the installed triton, at the launch configurations
the operator picks, across dtypes, (L, K, D), index widths and int64 / int32 spatial shapes. No GPU needed: triton's own ptxas
runs here. Run it without TRITON_INTERPRET (interpreted kernels cannot be compiled).

    python scripts/compile_check.py [--full]

Triton's compiler crashed on some tile shapes in one release and not in another (3.6, the H200's,
failed in a layout pass where 3.9 compiled; bench/NOTES.md): only a compile shows that, never the
interpreter. Prints each failure and a summary; exits 1 on any failure.

It also runs torch.compile's analysis of which arguments each kernel writes (over the kernel's
TTIR, as functionalization does): it must name the outputs alone. Were it to name an input,
compiled graphs would clone that input around every launch and copy the clone back over it
(msda/kernels/sampling.py says how a helper once caused that).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from msda.kernels.backward import backward_launch_config, msda_backward_kernel  # noqa: E402
from msda.kernels.forward import forward_launch_config, msda_forward_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# value, locations/weights, grad_value accumulator (triton pointer types), compute dtype
DTYPES = {
    "float32": ("fp32", "fp32", "fp32", tl.float32),
    "float16": ("fp16", "fp32", "fp16", tl.float32),
    "bfloat16": ("bf16", "bf16", "fp32", tl.float32),
    "float64": ("fp64", "fp64", "fp64", tl.float64),
}
# The preset, and shapes that crashed triton 3.6 (float64 tiles of 16 sample rows; bench/NOTES.md
# entries 8, 10 and 12).
QUICK_SHAPES = [(4, 4, 32), (3, 2, 24), (3, 3, 24), (1, 1, 64), (4, 2, 96)]
FULL_SHAPES = [(L, K, D) for L in (1, 3, 4) for K in (1, 2, 4, 8) for D in (1, 3, 8, 24, 32, 48, 64, 96, 256)]


def signatures(value: str, loc: str, accumulator: str, index: str) -> tuple[dict, dict]:
    ints = {name: "i32" for name in ("num_queries", "num_values", "num_heads", "head_dim")}
    forward = {"value_ptr": f"*{value}", "shapes_ptr": f"*{index}", "starts_ptr": f"*{index}",
               "loc_ptr": f"*{loc}", "attn_ptr": f"*{loc}", "out_ptr": f"*{value}", **ints}
    backward = {"grad_out_ptr": f"*{value}", "grad_out_stride_b": "i32", "grad_out_stride_q": "i32",
                "grad_out_stride_c": "i32", "value_ptr": f"*{value}", "shapes_ptr": f"*{index}",
                "starts_ptr": f"*{index}", "loc_ptr": f"*{loc}", "attn_ptr": f"*{loc}", "grad_value_ptr": f"*{accumulator}",
                "grad_loc_ptr": f"*{loc}", "grad_attn_ptr": f"*{loc}", **ints}
    return forward, backward


def compile_for_hopper(kernel, signature: dict, config: dict, constants: dict, head_dim: int) -> None:
    constexprs = {**{k: v for k, v in config.items() if k != "num_warps"}, **constants}
    # Pointers are 16-byte aligned (PyTorch allocations); D is divisible by 16 when it is.
    divisible = [name for name, kind in signature.items() if kind.startswith("*")]
    divisible += ["head_dim"] if head_dim % 16 == 0 else []
    source = ASTSource(
        kernel,
        {**signature, **{name: "constexpr" for name in constexprs}},
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible},
    )
    triton.compile(source, target=HOPPER, options={"num_warps": config["num_warps"]})


TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
                "i32": torch.int32, "i64": torch.int64}
OUTPUTS = {"msda_forward_kernel": ["out_ptr"],
           "msda_backward_kernel": ["grad_value_ptr", "grad_loc_ptr", "grad_attn_ptr"]}


def written_arguments(kernel, signature: dict, config: dict, constants: dict) -> list[str]:
    """The arguments torch.compile believes `kernel` writes, from its TTIR for sm_90. On an
    analysis error torch assumes every tensor is written: that fails the check too."""
    from torch._higher_order_ops import triton_kernel_wrap

    kwargs = {name: torch.empty(2, dtype=TORCH_DTYPES[kind[1:]]) if kind.startswith("*") else 2
              for name, kind in signature.items()}
    kwargs.update(constants, **{k: v for k, v in config.items() if k != "num_warps"})
    driver = triton.runtime.driver
    previous = driver._active  # reset_active() would look for a GPU driver, and there may be none
    driver.set_active(SimpleNamespace(get_current_target=lambda: HOPPER))
    try:
        if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # torch >= 2.12
            accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
            return sorted(dep.name for dep in accesses.read_writes.writes)
        return sorted(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}))
    finally:
        driver._active = previous


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="108 (L, K, D) shapes and int64 indices too")
    full = parser.parse_args().full
    failures = 0
    if full:
        cases = list(itertools.product(FULL_SHAPES, DTYPES.items(), (False, True), ("i64", "i32")))
    else:  # 64-bit indices at the preset only: its 16 x 1 forward tiles once crashed with them
        cases = list(itertools.product(QUICK_SHAPES, DTYPES.items(), (False,), ("i64", "i32")))
        cases += list(itertools.product(QUICK_SHAPES[:1], DTYPES.items(), (True,), ("i64", "i32")))
    for (levels, points, head_dim), (name, (value, loc, accumulator, compute)), index_64, shapes in cases:
        forward, backward = signatures(value, loc, accumulator, shapes)
        constants = dict(NUM_LEVELS=levels, NUM_POINTS=points, COMPUTE=compute, INDEX_64=index_64)
        for kernel, signature, config in (
            (msda_forward_kernel, forward,
             forward_launch_config(levels, points, head_dim, TORCH_DTYPES[value].itemsize, name == "float64")),
            (msda_backward_kernel, backward, backward_launch_config(levels, points, head_dim)),
        ):
            try:
                compile_for_hopper(kernel, signature, config, constants, head_dim)
                written = written_arguments(kernel, signature, config, constants)
                if written != sorted(OUTPUTS[kernel.__name__]):
                    raise AssertionError(f"torch.compile believes it writes {written}")
            except Exception as error:  # report every failing case, not just the first
                failures += 1
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                print(f"FAIL {kernel.__name__} {name} L={levels} K={points} D={head_dim} int64={index_64} "
                      f"shapes={shapes} {config}: {first_line}", flush=True)
    print(f"triton {triton.__version__}: {2 * len(cases) - failures} of {2 * len(cases)} kernels compiled for sm_90, "
          "torch.compile sees them write their outputs alone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
