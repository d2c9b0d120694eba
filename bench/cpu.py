"""CPU preset: msda's pure-PyTorch path against the grid_sample formulation that model code falls
back to without a compiled extension (mmcv's multi_scale_deformable_attn_pytorch, Hugging Face
transformers), eager and under torch.compile, in one process. Self-contained.

    python -m bench.cpu                                    # every cell below, 1 thread and all threads
    python -m bench.cpu --threads 1 --images 800x1333 --roles decoder --batches 1
    python -m bench.cpu --out bench/results/cpu-SHA.md     # also write the tables as markdown

Cells: Deformable DETR's four levels for an image size (strides 8, 16, 32, 64), 8 heads of 32,
4 points, float32, uniform sampling locations; the decoder (300 queries) and the encoder (a query
per token, Q = S); batch 1 and 2. Passes: forward (inference: no input requires grad) and
forward+backward (the output, then torch.autograd.grad with respect to value, sampling locations
and attention weights). Variants: msda (msda.multi_scale_deformable_attention), grid_sample (the
formulation, spatial shapes as Python ints as Hugging Face passes them), and each under
torch.compile(fullgraph=True, dynamic=True) (--static: dynamic=False, a compilation per cell).

On a machine whose cores other processes also use, OpenMP's default wait policy (spinning) can
make every parallel region wait for a descheduled thread, a scheduler tick each (8 ms measured on
the 2-vCPU machine of bench/results/cpu-*.md, niced): run with OMP_WAIT_POLICY=PASSIVE there, or
compare thread counts with care. The header prints the OpenMP environment and the load average.

Before the first cell the bench frees one 31 MiB block, which puts glibc's malloc in the state of
a process that has run a model (settle_allocator): without it a call's large temporaries can be
returned to the system when freed and fault their pages in again at the next call, at a cost of
up to 1.8x that fell on either variant depending on what the process had allocated before.

Timing: after warm-up calls (the first compiles), the four variants of a cell and pass take turns,
round after round, in this process; each sample is one call (CPU kernels are synchronous). The
tables show the median and the interquartile range in ms; speedup = grid_sample's median / msda's
(above 1: msda is faster), eager against eager and compiled against compiled.

Accuracy: each variant's output (forward pass) and gradients (forward+backward pass) against the
float64 oracle msda.testing.reference (computed a chunk of queries at a time), as the relative
error ||x - oracle|| / ||oracle||; ✗ above float32's bound, 1e-5.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

import msda
from msda.testing import TOLERANCE, Inputs, Shape, make_inputs, reference_with_grads, relative_error

from .variants import grid_sample_msda

HEADS, HEAD_DIM, POINTS, DECODER_QUERIES = 8, 32, 4, 300
PASSES = ("forward", "forward+backward")
VARIANTS = ("msda", "grid_sample", "msda compiled", "grid_sample compiled")
GRADIENTS = ("out", "∂value", "∂loc", "∂attn")
BOUND = TOLERANCE[torch.float32]

# glibc's malloc gives a freed block above its mmap threshold (128 KiB in a new process) back to the
# system, and trims the heap's top beyond twice that: each later call's temporaries (MiBs a chunk)
# then fault their pages in again, up to 3,700 faults and 1.8x the time a call at 400x667's decoder
# backward, in a process that had allocated little before (bench/NOTES.md entry 81). Freeing one
# mmapped block raises the threshold to its size (glibc caps it at 32 MiB) and the trim threshold
# to twice that, as any process that has run a model has done. Elsewhere this is one large
# allocation, freed.
SETTLE_BLOCK_BYTES = 31 * 2**20


def settle_allocator() -> None:
    """Put glibc's malloc in a model process's state before timing (SETTLE_BLOCK_BYTES)."""
    block = torch.empty(SETTLE_BLOCK_BYTES, dtype=torch.uint8)
    del block


def msda_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    return msda.multi_scale_deformable_attention(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )


def grid_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    return grid_sample_msda(value, spatial_shapes, sampling_locations, attention_weights)


def detr_levels(height: int, width: int) -> tuple[tuple[int, int], ...]:
    """(H, W) of Deformable DETR's levels for an image: a ResNet's strides 8, 16, 32 (each stride-2
    step rounds up) and one more stride-2 convolution."""
    h, w = -(-height // 8), -(-width // 8)
    levels = []
    for _ in range(4):
        levels.append((h, w))
        h, w = -(-h // 2), -(-w // 2)
    return tuple(levels)


@dataclass(frozen=True)
class Cell:
    image: tuple[int, int]
    role: str  # decoder or encoder
    batch: int

    @property
    def shape(self) -> Shape:
        levels = detr_levels(*self.image)
        queries = DECODER_QUERIES if self.role == "decoder" else sum(h * w for h, w in levels)
        return Shape(self.batch, queries, HEADS, HEAD_DIM, levels, POINTS)

    @property
    def label(self) -> tuple[str, str, str, str]:
        return f"{self.image[0]}x{self.image[1]}", self.role, str(self.shape.queries), str(self.batch)


@dataclass
class Row:
    cell: Cell
    threads: int
    pass_: str
    samples: dict[str, list[float]] = field(default_factory=dict)  # seconds per call

    def median_ms(self, variant: str) -> float | None:
        times = self.samples.get(variant)
        return 1e3 * statistics.median(times) if times else None

    def iqr_ms(self, variant: str) -> float:
        times = self.samples.get(variant) or []
        if len(times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        return 1e3 * (q3 - q1)

    def speedup(self, baseline: str, ours: str) -> float | None:
        theirs, mine = self.median_ms(baseline), self.median_ms(ours)
        return theirs / mine if theirs and mine else None


# --- Running -----------------------------------------------------------------------------------


def call_for(fn: Callable, args: tuple, pass_: str, grad_output: Tensor) -> Callable[[], tuple[Tensor, ...]]:
    """One call of the pass: the output, or the output and the three gradients."""
    value, spatial_shapes, level_start_index, loc, attn = args
    if pass_ == "forward":
        return lambda: (fn(*args),)
    leaves = tuple(t.detach().clone().requires_grad_() for t in (value, loc, attn))

    def step():
        out = fn(leaves[0], spatial_shapes, level_start_index, leaves[1], leaves[2])
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_output))

    return step


def round_robin(calls: dict[str, Callable], min_reps: int, max_reps: int, budget_s: float, log) -> dict:
    """Warm-up (two calls each; a compiled variant's first call compiles), then rounds of one call
    per variant, in a rotating order, until min_reps rounds and budget_s seconds (or max_reps)."""
    last = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        if first > 5:
            log(f"    {name}: first call {first:.1f} s")
        last[name] = call()
    samples = {name: [] for name in calls}
    names = list(calls)
    start = time.perf_counter()
    for rep in range(max_reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            last[name] = calls[name]()
            samples[name].append(time.perf_counter() - t0)
        if rep + 1 >= min_reps and time.perf_counter() - start >= budget_s:
            break
    return samples, last


def oracle(inputs: Inputs, grad_output: Tensor, queries_per_chunk: int = 1000) -> tuple[Tensor, ...]:
    """msda.testing.reference_with_grads a chunk of queries at a time (its float64 intermediates
    for all of an encoder's queries would not fit): output and gradients, float64."""
    Q = inputs.sampling_locations.shape[1]
    outs, grad_locs, grad_attns, grad_value = [], [], [], 0
    for first in range(0, Q, queries_per_chunk):
        part = slice(first, min(Q, first + queries_per_chunk))
        chunk = Inputs(
            inputs.value,
            inputs.spatial_shapes,
            inputs.level_start_index,
            inputs.sampling_locations[:, part],
            inputs.attention_weights[:, part],
        )
        out, gv, gl, ga = reference_with_grads(chunk, grad_output[:, part])
        outs.append(out)
        grad_locs.append(gl)
        grad_attns.append(ga)
        grad_value = grad_value + gv
    return torch.cat(outs, 1), grad_value, torch.cat(grad_locs, 1), torch.cat(grad_attns, 1)


@dataclass
class Config:
    threads: list[int]
    cells: list[Cell]
    passes: list[str]
    compile: bool
    static: bool
    compile_backend: str
    accuracy: bool
    min_reps: int
    max_reps: int
    budget_s: float


def run(config: Config, console: Console, after_row: Callable = lambda rows, errors: None) -> tuple[list[Row], dict]:
    """The rows (a cell, pass and thread count each) and the errors: {cell: {variant: {name: error}}},
    measured at the first thread count. after_row(rows, errors) is called after every row."""
    rows, errors, checked = [], {}, set()
    log = console.print
    settle_allocator()
    previous_threads = torch.get_num_threads()  # restored: a caller in this process keeps its own
    try:
        for threads in config.threads:
            torch.set_num_threads(threads)
            torch._dynamo.reset()  # Inductor's C++ code is generated for a thread count
            compiled = {}
            for cell in config.cells:
                inputs = make_inputs(cell.shape, torch.float32, seed=0)
                gen = torch.Generator().manual_seed(1)
                grad_output = torch.randn(cell.batch, cell.shape.queries, HEADS * HEAD_DIM, generator=gen)
                levels = [tuple(level) for level in inputs.spatial_shapes.tolist()]
                fns = {
                    "msda": (msda_fn, inputs.args()),
                    "grid_sample": (grid_fn, (inputs.value, levels, *inputs.args()[2:])),
                }
                if config.accuracy and cell not in errors:
                    start = time.perf_counter()
                    expected = oracle(inputs, grad_output)
                    log(f"  oracle for {' '.join(cell.label)}: {time.perf_counter() - start:.0f} s")
                for pass_ in config.passes:
                    calls = {}
                    for name, (fn, args) in fns.items():
                        calls[name] = call_for(fn, args, pass_, grad_output)
                        if config.compile:
                            key = (name, pass_, cell if config.static else None)
                            if key not in compiled:
                                compiled[key] = torch.compile(
                                    fn, fullgraph=True, dynamic=not config.static, backend=config.compile_backend
                                )
                            calls[f"{name} compiled"] = call_for(compiled[key], args, pass_, grad_output)
                    log(f"[{threads} thread{'s' if threads > 1 else ''}] {' '.join(cell.label)} {pass_}")
                    gc.collect()
                    samples, last = round_robin(calls, config.min_reps, config.max_reps, config.budget_s, log)
                    row = Row(cell, threads, pass_, samples)
                    rows.append(row)
                    log("    " + ", ".join(f"{v} {row.median_ms(v):.2f} ms" for v in calls))
                    if config.accuracy and (cell, pass_) not in checked:
                        checked.add((cell, pass_))
                        # The forward pass's output; the forward+backward pass's gradients.
                        which = (0,) if pass_ == "forward" else (1, 2, 3)
                        for name, results in last.items():
                            for i in which:
                                error = relative_error(results[i], expected[i])
                                errors.setdefault(cell, {}).setdefault(name, {})[GRADIENTS[i]] = error
                    after_row(rows, errors)
    finally:
        torch.set_num_threads(previous_threads)
    return rows, errors


# --- Reporting ---------------------------------------------------------------------------------


def machine(threads: list[int]) -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    root = Path(msda.__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True)
        commit = sha.stdout.strip() and sha.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        commit = "unknown"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return {
        "torch": torch.__version__,
        "msda": f"{getattr(msda, '__version__', '?')} at {commit or 'unknown'} ({root})",
        "CPU": f"{cpu}, {os.cpu_count()} logical CPUs",
        "threads": ", ".join(str(t) for t in threads) + f" (torch's default here: {torch.get_num_threads()})",
        "python": platform.python_version(),
        "OpenMP environment": ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                        "GOMP_SPINCOUNT") if k in os.environ) or "defaults",
        "load average (1, 5, 15 min) at start": load,
        "allocator": f"a {SETTLE_BLOCK_BYTES >> 20} MiB block freed before timing (glibc's thresholds raised)",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def fmt_ms(row: Row, variant: str) -> str:
    median = row.median_ms(variant)
    return "—" if median is None else f"{median:.2f} ±{row.iqr_ms(variant):.2f}"


def fmt_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def timing_table(rows: list[Row], threads: int) -> tuple[list[str], list[list[str]]]:
    header = ["image", "role", "Q", "B", "pass", "msda ms", "grid_sample ms", "speedup",
              "msda compiled ms", "grid_sample compiled ms", "speedup compiled"]
    body = []
    for row in rows:
        if row.threads != threads:
            continue
        body.append([*row.cell.label, row.pass_,
                     fmt_ms(row, "msda"), fmt_ms(row, "grid_sample"), fmt_ratio(row.speedup("grid_sample", "msda")),
                     fmt_ms(row, "msda compiled"), fmt_ms(row, "grid_sample compiled"),
                     fmt_ratio(row.speedup("grid_sample compiled", "msda compiled"))])
    return header, body


def accuracy_table(errors: dict) -> tuple[list[str], list[list[str]]]:
    header = ["image", "role", "Q", "B", "variant", *GRADIENTS]
    body = []
    for cell, by_variant in errors.items():
        for variant in VARIANTS:
            if variant not in by_variant:
                continue
            errs = by_variant[variant]
            shown = [f"{errs[g]:.1e}" + ("" if errs[g] <= BOUND else " ✗") if g in errs else "—" for g in GRADIENTS]
            body.append([*cell.label, variant, *shown])
    return header, body


def summary(rows: list[Row]) -> list[str]:
    lines = []
    for baseline, ours, what in (("grid_sample", "msda", "eager"),
                                 ("grid_sample compiled", "msda compiled", "compiled")):
        ratios = [(r.speedup(baseline, ours), r) for r in rows if r.speedup(baseline, ours) is not None]
        if not ratios:
            continue
        worst, row = min(ratios, key=lambda x: x[0])
        wins = sum(ratio >= 1 for ratio, _ in ratios)
        lines.append(f"{what}: msda at least as fast in {wins} of {len(ratios)} rows; smallest speedup "
                     f"{worst:.2f}× ({' '.join(row.cell.label)}, {row.pass_}, {row.threads} thread(s)), "
                     f"median speedup {statistics.median(r for r, _ in ratios):.2f}×")
    return lines


def rich_table(title: str, header: list[str], body: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 5 else "right", no_wrap=True)
    for line in body:
        table.add_row(*line)
    return table


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines)


def parse_list(text: str, convert=str) -> list:
    return [convert(x) for x in text.replace(" ", "").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,all", help="comma-separated thread counts; all = torch's default "
                        f"({torch.get_num_threads()} here). Default: 1,all")
    parser.add_argument("--images", default="800x1333,400x667", help="image sizes HxW (default: 800x1333,400x667)")
    parser.add_argument("--roles", default="decoder,encoder", help="decoder (300 queries), encoder (Q = S)")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--static", action="store_true",
                        help="torch.compile(dynamic=False), compiled per cell (default: dynamic=True, compiled once)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 oracle")
    parser.add_argument("--min-reps", type=int, default=5, help="rounds at least (default 5)")
    parser.add_argument("--max-reps", type=int, default=50, help="rounds at most (default 50)")
    parser.add_argument("--budget", type=float, default=5.0,
                        help="seconds of rounds per cell and pass, once min-reps are done (default 5)")
    parser.add_argument("--out", type=Path,
                        help="also write the tables to this markdown file (rewritten after every row)")
    return parser.parse_args(argv)


def tables_of(rows: list[Row], errors: dict, threads: list[int]) -> list[tuple[str, list[str], list[list[str]]]]:
    tables = [(f"{t} thread{'s' if t > 1 else ''}: median ± IQR ms per call", *timing_table(rows, t)) for t in threads]
    if errors:
        tables.append(("accuracy: relative error against the float64 oracle", *accuracy_table(errors)))
    return tables


def write_markdown(path: Path, info: dict, argv: list[str], rows: list[Row], errors: dict, threads: list[int],
                   elapsed: float, complete: bool) -> None:
    text = ["# msda CPU path against the grid_sample formulation (python -m bench.cpu)", ""]
    if not complete:
        text += ["**Incomplete: the run was still going or stopped; these are the rows measured so far.**", ""]
    text += [f"- {key}: {value}" for key, value in info.items()]
    text += [f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"- command: python -m bench.cpu {' '.join(argv)}".rstrip(),
             f"- elapsed: {elapsed / 60:.1f} min", ""]
    for title, header, body in tables_of(rows, errors, threads):
        text += [f"## {title}", "", markdown_table(header, body), ""]
    text += ["## summary", ""] + [f"- {line}" for line in summary(rows)] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    all_threads = torch.get_num_threads()
    threads = [all_threads if t == "all" else int(t) for t in parse_list(opts.threads)]
    images = [tuple(int(x) for x in image.split("x")) for image in parse_list(opts.images)]
    cells = [Cell(image, role, batch) for image in images for role in parse_list(opts.roles)
             for batch in parse_list(opts.batches, int)]
    config = Config(threads, cells, parse_list(opts.passes), not opts.no_compile, opts.static, opts.compile_backend,
                    not opts.no_accuracy, opts.min_reps, opts.max_reps, opts.budget)
    console = Console(width=None if sys.stdout.isatty() else 200)
    info = machine(threads)
    for key, value in info.items():
        console.print(f"{key}: {value}")
    start = time.time()

    def after_row(rows, errors):  # --out is rewritten after every row: a stopped run keeps its rows
        if opts.out:
            write_markdown(opts.out, info, argv, rows, errors, threads, time.time() - start, complete=False)

    rows, errors = run(config, console, after_row)
    elapsed = time.time() - start
    for title, header, body in tables_of(rows, errors, threads):
        console.print(rich_table(title, header, body))
    for line in summary(rows):
        console.print(line)
    console.print(f"elapsed {elapsed / 60:.1f} min")
    if opts.out:
        write_markdown(opts.out, info, argv, rows, errors, threads, elapsed, complete=True)
        console.print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
