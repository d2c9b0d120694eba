"""The float32 encoder backward with its coarsest level summed in shared memory (bench/NOTES.md
entry 49): the backward kernel with that level's grad_value adds masked off, then
`shared_tile_kernel.coarse_level_grad_value_kernel` for that level, against the launch rule.

    python -m bench.experiments.shared_tile            # on a CUDA GPU; graph us, profiler us a kernel

The masked backward kernel is msda's own with one constexpr added (`ADD_HI`: adds only on the
levels below it), written into a temporary copy of the package that this script imports instead,
so that msda itself stays as it is."""
from __future__ import annotations

import importlib
import pathlib
import shutil
import sys
import tempfile

import torch

_MASKS = ("(left & top)", "(right & top)", "(left & bottom)", "(right & bottom)")


def masked_msda(root: pathlib.Path) -> pathlib.Path:
    """A copy of the msda package under `root` whose backward kernel takes ADD_HI."""
    source = pathlib.Path(__file__).resolve().parents[2] / "msda"
    target = root / "msda"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / "kernels" / "backward.py"
    text = path.read_text()
    last = "COUNT_STRIDE: tl.constexpr,  # > 0: count each sample into its list, counters this many int32 apart\n):"
    assert text.count(last) == 1, "the backward kernel's signature moved: update this script"
    text = text.replace(last, last[:-2] + "\n    ADD_HI: tl.constexpr = 99,  # adds on the levels below this\n):")
    for mask in _MASKS:
        old = f"mask={mask}[:, :, None, None] & d_ok,\n                    sem=\"relaxed\","
        assert text.count(old) == 1, f"the {mask} add moved: update this script"
        text = text.replace(old, old.replace("& d_ok,", "& d_ok & (level < ADD_HI),"))
    path.write_text(text)
    return root


def main() -> None:
    root = masked_msda(pathlib.Path(tempfile.mkdtemp()))
    sys.path.insert(0, str(root))
    for name in [n for n in sys.modules if n == "msda" or n.startswith("msda.")]:
        del sys.modules[name]
    launch = importlib.import_module("msda.kernels.launch")
    backward = importlib.import_module("msda.kernels.backward")
    testing = importlib.import_module("msda.testing")
    from bench.phases import kernel_times
    from bench.timing import graph_device_time
    from bench.tune import backward_launch

    from .shared_tile_kernel import coarse_level_grad_value_kernel

    def split_launch(inputs, grad_output, tile, queries_a_program):
        value, shapes, starts, loc, attn = inputs.args()
        B, S, M, D = value.shape
        Q, L, K = loc.shape[1], loc.shape[3], loc.shape[4]
        grads = (torch.zeros(value.shape, dtype=torch.float32, device=value.device), torch.empty_like(loc),
                 torch.empty_like(attn))  # fmt: skip
        grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, *grads, tile)
        constexprs = dict(constexprs, ADD_HI=L - 1)
        tile_grid = (B * M * -(-Q // queries_a_program),)

        def run():
            backward.zero_(grads[0])
            backward.msda_backward_kernel[grid](*args, **constexprs)
            coarse_level_grad_value_kernel[tile_grid](
                grad_output, shapes, starts, loc, attn, grads[0], Q, S, LVL=L - 1, NUM_HEADS=M, HEAD_DIM=D,
                NUM_LEVELS=L, NUM_POINTS=K, QB=queries_a_program, DUMMY=287, STAGE=288, ROWS=320, num_warps=4,
            )  # fmt: skip

        return run, grads

    def timed(run, grads, expected):
        run()
        torch.cuda.synchronize()
        errors = [testing.relative_error(g, r) for g, r in zip(grads, expected)]
        graph = graph_device_time(run, calls=5, replays=5).median_us
        kernels = ", ".join(f"{name[:24]} {us:.1f}" for name, us in kernel_times(run, 5))
        return f"{graph:.1f} [{kernels}] grad_value error {errors[0]:.1e}, worst {max(errors):.1e}"

    preset = testing.PRESETS["encoder"]
    for dist in ("uniform", "local"):
        inputs = testing.make_inputs(preset, torch.float32, "cuda", dist=dist, seed=3)
        grad = torch.randn(inputs.value.shape[0], preset.queries, preset.heads * preset.head_dim, device="cuda")
        expected = testing.reference_with_grads(inputs, grad)[1:]
        tile = launch.backward_config(4, 4, preset.head_dim, torch.float32, True)
        print(f"encoder {dist} float32, the rule: " + timed(*backward_launch(inputs, grad, tile), expected), flush=True)
        for queries in (128, 256, 64):
            run, grads = split_launch(inputs, grad, tile, queries)
            print(f"encoder {dist} float32, shared tile, {queries} queries a program: " + timed(run, grads, expected),
                  flush=True)


if __name__ == "__main__":
    main()
