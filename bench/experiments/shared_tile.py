"""The float32 encoder backward with its coarsest level summed in shared memory (bench/NOTES.md
entry 49): the backward kernel with that level's grad_value adds masked off, then
`shared_tile_kernel.coarse_level_grad_value_kernel` for that level, against the launch rule.

    python -m bench.experiments.shared_tile            # on a CUDA GPU; graph us, profiler us a kernel
    python -m bench.experiments.shared_tile --check    # edge cases against the float64 oracle

The masked backward kernel is msda's own with one constexpr added (`TILE_PIXELS`: the last
level's adds are left out where it has at most that many pixels, as the tile kernel sums it
exactly there), written into a temporary copy of the package that this script imports instead,
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
    """A copy of the msda package under `root` whose backward kernel takes TILE_PIXELS."""
    source = pathlib.Path(__file__).resolve().parents[2] / "msda"
    target = root / "msda"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / "kernels" / "backward.py"
    text = path.read_text()
    last = "COUNT_STRIDE: tl.constexpr,  # > 0: count each sample into its list, counters this many int32 apart\n):"
    assert text.count(last) == 1, "the backward kernel's signature moved: update this script"
    added = "\n    TILE_PIXELS: tl.constexpr = 0,  # bench/experiments/shared_tile.py\n):"
    text = text.replace(last, last[:-2] + added)
    for mask in _MASKS:
        old = f"mask={mask}[:, :, None, None] & d_ok,\n                    sem=\"relaxed\","
        assert text.count(old) == 1, f"the {mask} add moved: update this script"
        kept = "& d_ok & ((level != NUM_LEVELS - 1) | (h * w > TILE_PIXELS)),"
        text = text.replace(old, old.replace("& d_ok,", kept))
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

    def split_launch(inputs, grad_output, tile, queries_a_program, level_starts=True):
        value, shapes, starts, loc, attn = inputs.args()
        starts = starts if level_starts else None
        B, S, M, D = value.shape
        Q, L, K = loc.shape[1], loc.shape[3], loc.shape[4]
        grads = (torch.zeros(value.shape, dtype=torch.float32, device=value.device), torch.empty_like(loc),
                 torch.empty_like(attn))  # fmt: skip
        grid, args, constexprs = launch.backward_call(grad_output, value, shapes, starts, loc, attn, *grads, tile)
        constexprs = dict(constexprs, TILE_PIXELS=DUMMY)
        tile_grid = (B * M * -(-Q // queries_a_program),)

        def run():
            backward.zero_(grads[0])
            backward.msda_backward_kernel[grid](*args, **constexprs)
            coarse_level_grad_value_kernel[tile_grid](
                grad_output, grad_output.stride(0), grad_output.stride(1), shapes, shapes if starts is None else starts,
                loc, attn, grads[0], Q, S, LVL=L - 1, NUM_HEADS=M, HEAD_DIM=D, NUM_LEVELS=L, NUM_POINTS=K,
                QB=queries_a_program, DUMMY=DUMMY, STAGE=DUMMY + 1, ROWS=DUMMY + 33, LEVEL_STARTS=starts is not None,
                num_warps=4,
            )  # fmt: skip

        return run, grads

    def timed(run, grads, expected):
        run()
        torch.cuda.synchronize()
        errors = [testing.relative_error(g, r) for g, r in zip(grads, expected)]
        graph = graph_device_time(run, calls=5, replays=5).median_us
        kernels = ", ".join(f"{name[:24]} {us:.1f}" for name, us in kernel_times(run, 5))
        return f"{graph:.1f} [{kernels}] grad_value error {errors[0]:.1e}, worst {max(errors):.1e}"

    if "--check" in sys.argv:
        check(testing, launch, split_launch)
        return
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


DUMMY = 287  # the tile's rows: a level of at most this many pixels, then the row corners outside add to


def check(testing, launch, split_launch) -> None:
    """The split backward against the float64 oracle at shapes the preset does not reach: samples
    outside the levels, Q not a multiple of a program's queries, a last level of exactly DUMMY
    pixels and one past it (the tile kernel then does nothing and the backward kernel adds it), an
    expanded grad_output, no level starts, fewer queries than pixels."""
    cases = [
        ("small encoder, a quarter outside", ((24, 30), (12, 15), (6, 8), (3, 4)), None, {}),
        ("last level 7 x 41 = 287 pixels", ((14, 82), (7, 41)), None, {}),
        ("last level 18 x 17 = 306 pixels", ((20, 25), (18, 17)), None, {}),
        ("expanded grad_output", ((24, 30), (12, 15), (6, 8), (3, 4)), None, {"expanded": True}),
        ("no level starts", ((24, 30), (12, 15), (6, 8), (3, 4)), None, {"level_starts": False}),
        ("300 queries", ((24, 30), (12, 15), (6, 8), (3, 4)), 300, {}),
    ]
    worst = 0.0
    for name, levels, queries, options in cases:
        S = sum(h * w for h, w in levels)
        shape = testing.Shape(batch=2, queries=queries or S, heads=8, head_dim=32, levels=levels, points=4)
        inputs = testing.make_inputs(shape, torch.float32, "cuda", outside_fraction=0.25, seed=7)
        B, Q, MD = shape.batch, shape.queries, shape.heads * shape.head_dim
        grad = (torch.randn(B, 1, MD, device="cuda").expand(B, Q, MD) if options.get("expanded")
                else torch.randn(B, Q, MD, device="cuda"))  # fmt: skip
        expected = testing.reference_with_grads(inputs, grad)[1:]
        tile = launch.backward_config(len(levels), 4, 32, torch.float32, queries is None)
        for queries_a_program in (64, 256):
            run, grads = split_launch(inputs, grad, tile, queries_a_program, options.get("level_starts", True))
            run()
            torch.cuda.synchronize()
            errors = [testing.relative_error(g, r) for g, r in zip(grads, expected)]
            worst = max(worst, *errors)
            print(f"{name}, {queries_a_program} queries a program: errors " + ", ".join(f"{e:.1e}" for e in errors))
    bound = testing.TOLERANCE[torch.float32]
    print(f"worst {worst:.1e} against the float32 bound {bound:.0e}: " + ("within" if worst <= bound else "OVER"))


if __name__ == "__main__":
    main()
