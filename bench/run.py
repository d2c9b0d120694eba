"""The bench's loop: for each cell (preset, dtype, distribution) build every variant, check it
against the float64 oracle, time its forward and its backward, and make one row of each.

A variant that raises becomes a row with the error; the run goes on. Compiled callables are
kept across cells (torch.compile(dynamic=True) compiles once per dtype, not per preset).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from msda.testing import TOLERANCE, make_inputs, relative_error

from . import model
from .machine import gpu_clocks, machine_info
from .schema import PASSES, STATUSES, new_row, primary_timing
from .schema import new_results as empty_results
from .tables import print_header
from .timing import (
    Timing,
    agree,
    cpu_time,
    end_to_end_time,
    graph_device_time,
    peak_memory_bytes,
    profiler_device_time,
    warm_up,
)
from .variants import DTYPES, PRESETS, RESULT_NAMES, Case, Cell, Unavailable, Variant, expected

# Repetitions, kept modest so that the default GPU run stays within a few minutes: each
# profiler repeat and each graph holds about PROFILE_SECONDS of calls (3 to 20 calls), each
# end-to-end repeat about E2E_SECONDS (5 to 100 calls).
PROFILE_SECONDS, PROFILER_REPEATS, GRAPH_REPLAYS = 0.02, 5, 10
E2E_SECONDS, E2E_REPEATS = 0.05, 5
CPU_MIN_RUN_TIME = {"smoke": 0.1}  # seconds per torch.utils.benchmark measurement; 0.5 otherwise
CPU_TURNS = 3  # forward and forward+backward measured in turns where the backward is their difference
CPU_DERIVED_ROUNDS = 3  # rounds of turns at most, while that difference is not positive
TRACE_STEPS = 3


@dataclass
class Config:
    presets: list[str]
    dtypes: list[str]
    dists: list[str]
    device: torch.device
    variants: list[Variant]
    compile_backend: str
    threads: int
    trace: Path | None = None


def new_results(config: Config) -> dict:
    """The results of a run before its first cell (bench.schema lays them out)."""
    return empty_results(
        machine_info(config.device, config.threads),
        {
            "presets": config.presets,
            "dtypes": config.dtypes,
            "dists": config.dists,
            "device": str(config.device),
            "variants": [v.name for v in config.variants],
            "compile_backend": config.compile_backend,
            "threads": config.threads,
        },
    )


def run(config: Config, results: dict, console: Console, checkpoint: Callable[[dict], None] | None = None) -> None:
    """Run every cell, adding its rows to `results` (from new_results) as it goes.

    `checkpoint(results)` is called after each cell (to write results.json as the run goes).
    """
    started = time.perf_counter()
    device = config.device
    _limit_recompiles()
    print_header(results, console)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _start_profiler()
    bandwidth = model.copy_bandwidth(device, config.threads)
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    console.print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s")

    cells = [(p, d, s) for p in config.presets for d in config.dtypes for s in config.dists]
    compiled: dict = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("bench", total=len(cells) * len(config.variants))
        for index, (preset, dtype_name, dist) in enumerate(cells, 1):
            cell_started = time.perf_counter()
            rows = _run_cell(config, preset, dtype_name, dist, compiled, bandwidth, progress, task)
            results["rows"].extend(rows)
            results["elapsed_s"] = time.perf_counter() - started
            summary = _count_variants(rows)
            progress.console.print(
                f"[{index}/{len(cells)}] {preset} {dtype_name} {dist}: {summary} "
                f"({time.perf_counter() - cell_started:.1f} s, {results['elapsed_s']:.0f} s in all)"
            )
            if checkpoint is not None:
                checkpoint(results)
    if device.type == "cuda":
        results["machine"]["clocks_after"] = gpu_clocks()
    results["complete"] = True
    results["elapsed_s"] = time.perf_counter() - started


def _count_variants(rows: list[dict]) -> str:
    """'7 ok, 1 error, 2 unavailable': a variant counts as its worst row."""
    worst = {}
    for r in rows:
        rank = STATUSES.index(r["status"]) if r["status"] != "ok" else -1
        worst[r["variant"]] = max(worst.get(r["variant"], -1), rank)
    counts = {s: sum(v == (i if s != "ok" else -1) for v in worst.values()) for i, s in enumerate(STATUSES)}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def _run_cell(config, preset, dtype_name, dist, compiled, bandwidth, progress, task) -> list[dict]:
    shape, dtype, device = PRESETS[preset], DTYPES[dtype_name], config.device
    base = {"preset": preset, "dtype": dtype_name, "dist": dist}
    try:
        inputs = make_inputs(shape, dtype, device, dist=dist, seed=0)
        gen = torch.Generator().manual_seed(1)
        grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, generator=gen)
        grad = grad.to(device, dtype)
        cell = Cell(preset, shape, dtype, dist, device, inputs, grad, config.compile_backend, compiled)
    except Exception as e:  # the whole cell fails: one error row per variant, the run goes on
        progress.advance(task, len(config.variants))
        return [_row(base, v, p, "error", f"inputs: {_describe(e)}") for v in config.variants for p in PASSES]

    rows, traced = [], []
    for variant in config.variants:
        progress.update(task, description=f"{preset} {dtype_name} {dist} · {variant.name}")
        variant_rows, case = _run_variant(variant, cell, config, bandwidth)
        rows.extend(variant_rows)
        for r in variant_rows:
            if r["status"] == "error":
                progress.console.print(f"  {variant.name} {r['pass']}: {r['note']}", markup=False)
        if (variant_rows[0]["setup_s"] or 0) > 5:
            progress.console.print(f"  {variant.name}: {variant_rows[0]['setup_s']:.1f} s to build, compile and check")
        if case is not None and config.trace is not None:
            traced.append((variant.name, case))
        del case
        _free(device)
        progress.advance(task)
    _rank(rows)
    if traced:
        path = config.trace / f"trace_{preset}_{dtype_name}_{dist}.json"
        try:
            _trace(traced, path, device)
            progress.console.print(f"  trace: {path}", markup=False)
        except Exception as e:
            progress.console.print(f"  trace failed: {_describe(e)}", markup=False)
    del cell, traced
    gc.collect()
    _free(device)
    return rows


def _run_variant(variant: Variant, cell: Cell, config: Config, bandwidth: float) -> tuple[list[dict], Case | None]:
    base = {"preset": cell.preset, "dtype": str(cell.dtype)[6:], "dist": cell.dist}
    if variant.needs_cuda and cell.device.type != "cuda":
        return [_row(base, variant, p, "skipped", "needs CUDA") for p in PASSES], None
    started = time.perf_counter()
    try:
        case = variant.build(cell)
    except Unavailable as e:
        return [_row(base, variant, p, "unavailable", str(e)) for p in PASSES], None
    except Exception as e:
        return [_row(base, variant, p, "error", f"build: {_describe(e)}") for p in PASSES], None

    # Correctness first, on the same inputs that are timed: a fast wrong kernel must not win.
    try:
        actual = case.results()
        setup_s = time.perf_counter() - started  # build, first calls (compilation) and one check call
        reference = expected(cell, variant.scope)
        errors = {name: relative_error(a, r) for name, a, r in zip(RESULT_NAMES[variant.scope], actual, reference)}
        del actual
    except Exception as e:
        return [_row(base, variant, p, "error", f"check: {_describe(e)}") for p in PASSES], None

    names = RESULT_NAMES[variant.scope]
    rows = {
        p: _row(base, variant, p, "ok", "", errors={n: errors[n] for n in (names[:1] if p == "forward" else names[1:])})
        for p in PASSES
    }
    if case.backward is not None:
        try:  # a peer's backward may not run twice on one forward: then time step minus forward
            case.backward()
        except Exception as e:
            rows["backward"]["notes"].append(f"backward alone failed ({_describe(e)})")
            case.backward, case.capture_backward = None, False
    try:
        if cell.device.type == "cuda":
            _time_cuda(case, rows)
        else:
            min_run_time = CPU_MIN_RUN_TIME.get(cell.preset, 0.5)
            _time_cpu(case, rows, config.threads, min_run_time)
    except Exception as e:  # a failure outside the per-column guards: a row keeps what it has
        for r in rows.values():
            if primary_timing(r) is None:
                r["status"], r["note"] = "error", f"timing: {_describe(e)}"
    for p, r in rows.items():
        r["setup_s"] = setup_s
        r["tolerance"], r["errors_ok"] = judge_errors(variant.scope, cell.dtype, r["errors"])
        r["time_us"] = (primary_timing(r) or {}).get("median")
        if variant.scope == "op":
            r["min_bytes"] = model.min_bytes(cell.shape, cell.dtype, cell.inputs.sampling_locations.dtype, p)
            if r["time_us"] is not None and r["time_us"] > 0:
                r["floor_fraction"] = model.floor_fraction(r["min_bytes"], bandwidth, r["time_us"])
        if r["status"] == "ok" and r["time_us"] is None:
            r["status"], r["note"], r["notes"] = "error", "; ".join(r["notes"]) or "no timing", []
    return list(rows.values()), case


# --- Timing ------------------------------------------------------------------------------------


def _time_cuda(case: Case, rows: dict[str, dict]) -> None:
    fwd, bwd = rows["forward"], rows["backward"]
    forward = _cuda_columns(case.forward, fwd, graph=case.capturable)
    if case.backward is not None:
        backward = _cuda_columns(case.backward, bwd, graph=case.capture_backward)
        if not case.capture_backward and case.capturable:
            # Autograd's backward cannot be captured alone (its forward ran outside the capture):
            # capture forward+backward together and subtract the forward's graph time.
            case.release()  # no autograd node made on the default stream left for the capture to meet
            calls, _ = _counts(case.step)
            step = _guarded(bwd, "graph", lambda: graph_device_time(case.step, calls, GRAPH_REPLAYS))
            backward["graph"] = _minus(bwd, "graph", step, forward["graph"])
            bwd["notes"].append("graph: (forward+backward) - forward")
    else:
        step = _cuda_columns(case.step, bwd, graph=case.capturable)
        backward = {k: _minus(bwd, k, step[k], forward[k]) for k in ("profiler", "graph", "e2e")}
        backward["peak"] = step["peak"]
        bwd["notes"].append("backward = (forward+backward) - forward; peak of forward+backward")
    for row, columns in ((fwd, forward), (bwd, backward)):
        for key in ("profiler", "graph", "e2e"):
            row[f"{key}_us"] = _stats(columns[key])
        row["peak_bytes"] = columns["peak"]
        if columns["profiler"] is not None and columns["graph"] is not None:
            row["agree"] = agree(columns["profiler"].median_us, columns["graph"].median_us)
        if columns["profiler"] is not None and columns["profiler"].median_us <= 0:
            row["notes"].append("profiler: no device time (no events, or a difference within noise)")
    if not case.capturable:
        for row in (fwd, bwd):
            row["notes"].append("graph: n/a, the variant replays CUDA graphs itself")


def _cuda_columns(fn: Callable[[], object], row: dict, graph: bool) -> dict:
    """Profiler and graph-replay device time, end-to-end time and peak memory of `fn`."""
    calls, e2e_calls = _counts(fn)
    return {
        "profiler": _guarded(row, "profiler", lambda: profiler_device_time(fn, calls, PROFILER_REPEATS)),
        "graph": _guarded(row, "graph", lambda: graph_device_time(fn, calls, GRAPH_REPLAYS)) if graph else None,
        "e2e": _guarded(row, "e2e", lambda: end_to_end_time(fn, e2e_calls, E2E_REPEATS)),
        "peak": _guarded(row, "peak", lambda: peak_memory_bytes(fn)),
    }


def _time_cpu(case: Case, rows: dict[str, dict], threads: int, min_run_time: float) -> None:
    fwd, bwd = rows["forward"], rows["backward"]
    if case.backward is not None:
        forward = _guarded(fwd, "timer", lambda: cpu_time(case.forward, threads, min_run_time))
        backward = _guarded(bwd, "timer", lambda: cpu_time(case.backward, threads, min_run_time))
    else:
        # The forward and the step take turns, so that a spell of load on the host weighs on
        # both sides of the difference, not on one.
        # Where a spell of load still leaves the difference at or under zero, more turns are
        # measured (up to CPU_DERIVED_ROUNDS rounds, every sample kept) before it is called noise.
        forward = step = Timing(samples_us=[])
        turn_time = min_run_time / CPU_TURNS
        for rounds in range(1, CPU_DERIVED_ROUNDS + 1):
            for _ in range(CPU_TURNS):
                forward = _joined(forward, _guarded(fwd, "timer", lambda: cpu_time(case.forward, threads, turn_time)))
                step = _joined(step, _guarded(bwd, "timer", lambda: cpu_time(case.step, threads, turn_time)))
                if forward is None or step is None:
                    break
            if forward is None or step is None or step.median_us > forward.median_us:
                break
        backward = _minus(bwd, "timer", step, forward)
        bwd["notes"].append("backward = (forward+backward) - forward" + (f", {rounds} rounds" if rounds > 1 else ""))
    fwd["e2e_us"], bwd["e2e_us"] = _stats(forward), _stats(backward)


def _counts(fn: Callable[[], object]) -> tuple[int, int]:
    """Calls per profiler repeat or graph, and per end-to-end repeat, from one timed call."""
    warm_up(fn, calls=2)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    seconds = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(max(PROFILE_SECONDS / seconds, 3), 20))
    e2e_calls = int(min(max(E2E_SECONDS / seconds, 5), 100))
    return calls, e2e_calls


def _guarded(row: dict, column: str, measure: Callable[[], object]):
    """`measure()`, or None with a note in the row when it raises."""
    try:
        return measure()
    except Exception as e:
        row["notes"].append(f"{column}: {_describe(e)}")
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
        return None


def _minus(row: dict, column: str, a: Timing | None, b: Timing | None) -> Timing | None:
    """a - b as a Timing: a's samples shifted by b's median (the spread is a's). None, with a note
    in the row, where either is missing or the difference is not positive: then the two timings'
    noise is larger than what they differ by, and no number is the backward's."""
    if a is None or b is None or not a.samples_us or not b.samples_us:
        return None
    difference = Timing(samples_us=[s - b.median_us for s in a.samples_us])
    if difference.median_us <= 0:
        row["notes"].append(
            f"{column}: (forward+backward) - forward is {difference.median_us:.1f} us: within the timings' noise"
        )
        return None
    return difference


def _joined(a: Timing | None, b: Timing | None) -> Timing | None:
    """The samples of both, or None once either is missing (a measurement failed)."""
    return None if a is None or b is None else Timing(samples_us=a.samples_us + b.samples_us)


def _stats(t: Timing | None) -> dict | None:
    if t is None or not t.samples_us:
        return None
    return {"median": t.median_us, "iqr": t.iqr_us, "n": len(t.samples_us)}


# --- Ratios ------------------------------------------------------------------------------------


def judge_errors(scope: str, dtype: torch.dtype, errors: dict) -> tuple[float | None, bool | None]:
    """(tolerance, errors_ok) of a row. Op rows are held to the dtype's bound in docs/contract.md. Block
    rows are shown, not judged: their error is mostly the block's own arithmetic in the dtype
    (half-precision projections, float32 sampling locations whose rounding moves a few samples
    across pixel borders, where the location gradient jumps), which no operator can meet the
    operator's bound through."""
    if scope != "op":
        return None, None
    tolerance = TOLERANCE[dtype]
    return tolerance, all(e <= tolerance for e in errors.values())


def _rank(rows: list[dict]) -> None:
    """best baseline / row, for device and end-to-end time, within each (scope, pass).

    The best baseline is the fastest baseline row whose errors are within tolerance (if none
    is, the fastest measured baseline). Above 1: faster than the best baseline.
    """
    for scope in {r["scope"] for r in rows}:
        for p in PASSES:
            group = [r for r in rows if r["scope"] == scope and r["pass"] == p and r["status"] == "ok"]
            for ratio_key, time_of in (("ratio", _time_of), ("ratio_e2e", _e2e_of)):
                baselines = [r for r in group if r["baseline"] and time_of(r) is not None]
                trusted = [r for r in baselines if r["errors_ok"]] or baselines
                if not trusted:
                    continue
                best = min(trusted, key=time_of)
                for r in group:
                    if time_of(r) is not None:
                        r[ratio_key] = time_of(best) / time_of(r)
                        if ratio_key == "ratio":
                            r["best_baseline"] = best["variant"]


def _time_of(row: dict) -> float | None:
    t = row["time_us"]
    return t if t is not None and t > 0 else None


def _e2e_of(row: dict) -> float | None:
    t = (row["e2e_us"] or {}).get("median")
    return t if t is not None and t > 0 else None


# --- Rows and helpers --------------------------------------------------------------------------


def _row(base: dict, variant: Variant, pass_: str, status: str, note: str, errors: dict | None = None) -> dict:
    """A row of results.json (bench.schema.ROW) for `variant` in the cell `base` names."""
    return new_row(**base, variant=variant.name, scope=variant.scope, baseline=variant.baseline,
                   description=variant.description, status=status, note=note, errors=errors or {},
                   **{"pass": pass_})


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _limit_recompiles() -> None:
    """Several dtypes and two modes of one layer's forward exceed dynamo's default of 8 entries."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))


def _start_profiler() -> None:
    """One short profile before any CUDA graph is captured: the profiler's first start is slow,
    and graphs captured before it started may show no kernels to it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()


def _trace(cases: list[tuple[str, Case]], path: Path, device: torch.device) -> None:
    """A Chrome/Perfetto trace of a few steps of each variant, one range per forward and backward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        for name, case in cases:
            for _ in range(TRACE_STEPS):
                with record_function(f"{name} forward"):
                    case.forward()
                if case.backward is not None:
                    with record_function(f"{name} backward"):
                        case.backward()
                else:
                    with record_function(f"{name} forward+backward"):
                        case.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
