"""What the bench shows and writes: the machine header, a table per cell on the terminal,
results.json (every number), results.md (the tables) and results.png (time per variant).

bench/README.md says how to read every column.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

import msda

STATUSES = ("ok", "error", "unavailable", "skipped")
# Short names of the error columns; a block row's gradients stand in the op's columns.
LABELS = {
    "output": "out",
    "grad_value": "∂value",
    "grad_sampling_locations": "∂loc",
    "grad_attention_weights": "∂attn",
    "grad_input_flatten": "∂input",
    "grad_reference_points": "∂ref",
    "grad_query": "∂query",
}
ERROR_COLUMNS = ("err out", "err ∂value/∂input", "err ∂loc/∂ref", "err ∂attn/∂query")

# --- The machine -------------------------------------------------------------------------------


def machine_info(device: torch.device, threads: int) -> dict:
    info = {
        "device": str(device),
        "gpu": None,
        "clocks": None,
        "cpu": _cpu_name(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "msda": msda.__version__,
        "msda_backend": msda.ops.BACKEND,
        "peers": {"deformops": _version("deformops"), "mmcv": _version("mmcv") or _version("mmcv-lite")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
        info["clocks"] = gpu_clocks()
    return info


def gpu_clocks() -> dict | None:
    """Clocks and limits from nvidia-smi (MHz, W), or None without it."""
    fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def header_lines(results: dict) -> list[str]:
    m, c = results["machine"], results["config"]
    lines = []
    if m["gpu"]:
        clocks = m.get("clocks") or {}
        line = f"GPU: {m['gpu']} ({m.get('gpu_memory_GiB')} GiB, {m.get('multiprocessors')} SMs)"
        if clocks:
            line += (f", driver {clocks.get('driver_version')}, SM clock {clocks.get('clocks.sm')} "
                     f"(max {clocks.get('clocks.max.sm')}), memory clock {clocks.get('clocks.mem')} "
                     f"(max {clocks.get('clocks.max.mem')}), power limit {clocks.get('power.limit')}")
        else:
            line += ", clocks: nvidia-smi not available"
        lines.append(line)
        after = m.get("clocks_after")
        if after:
            lines.append(f"clocks after the run: SM {after.get('clocks.sm')}, memory {after.get('clocks.mem')}, "
                         f"power {after.get('power.draw')}")
    lines.append(f"CPU: {m['cpu']}, {m['threads']} threads")
    peers = ", ".join(f"{k} {v or 'not installed'}" for k, v in m["peers"].items())
    lines.append(f"python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), triton {m['triton']}, "
                 f"msda {m['msda']} (backend {m['msda_backend']}); peers: {peers}")
    lines.append(f"presets {', '.join(c['presets'])}; dtypes {', '.join(c['dtypes'])}; dist {', '.join(c['dists'])}; "
                 f"device {c['device']}; torch.compile backend {c['compile_backend']}; {m['date']}")
    if results.get("copy_bandwidth_GBps"):
        lines.append(f"copy bandwidth (read + write, measured): {results['copy_bandwidth_GBps']:.0f} GB/s")
    for source in results.get("sources", []):  # a merge of runs (see merge())
        bandwidth = source["copy_bandwidth_GBps"]
        lines.append(f"cells {', '.join(source['cells'])}: {source['label']} ({source['date']}"
                     + (f", copy bandwidth {bandwidth:.0f} GB/s)" if bandwidth else ")"))
    return lines


def print_header(results: dict, console: Console) -> None:
    for line in header_lines(results):
        console.print(line, highlight=False, markup=False)


# --- Tables ------------------------------------------------------------------------------------


def cells(results: dict) -> list[tuple[str, str, str]]:
    seen = []
    for r in results["rows"]:
        key = (r["preset"], r["dtype"], r["dist"])
        if key not in seen:
            seen.append(key)
    return seen


def _rows_of(results: dict, cell: tuple[str, str, str]) -> list[dict]:
    return [r for r in results["rows"] if (r["preset"], r["dtype"], r["dist"]) == cell]


def _timing(t: dict | None) -> str:
    return "—" if t is None else f"{t['median']:.1f} ±{t['iqr']:.1f}"


def _err(value, tolerance) -> str:
    if value is None:
        return "—"
    if isinstance(value, str) or not math.isfinite(value):
        return f"{value} ✗"
    mark = " ✗" if tolerance is not None and value > tolerance else ""
    return f"{value:.1e}{mark}"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _percent(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def _agree(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "NO")


def _mib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f}"


def _worst_error(row: dict) -> str:
    """The forward's output error, or the largest gradient error with its name."""
    errors = row["errors"]
    if not errors:
        return "—"
    name, value = max(errors.items(), key=lambda kv: _sortable(kv[1]))
    text = _err(value, row["tolerance"])
    return text if row["pass"] == "forward" else f"{text} {LABELS.get(name, name)}"


def _sortable(v) -> float:
    return math.inf if isinstance(v, str) else v


def _note(row: dict) -> str:
    return "; ".join(n for n in [row["note"], *row["notes"]] if n)


def table_columns(on_gpu: bool) -> list[str]:
    if on_gpu:
        return ["variant", "pass", "profiler µs", "graph µs", "agree", "e2e µs", "peak MiB", "error", "vs best",
                "vs best e2e", "% floor", "note"]
    return ["variant", "pass", "time µs", "error", "vs best", "% floor", "note"]


def table_cells(row: dict, on_gpu: bool, note_width: int | None = None) -> list[str]:
    note = _note(row) if row["status"] == "ok" else f"{row['status']}: {_note(row)}"
    if note_width is not None and len(note) > note_width:
        note = note[: note_width - 1] + "…"
    if row["status"] in ("unavailable", "skipped"):
        empty = ["—"] * (len(table_columns(on_gpu)) - 3)
        return [row["variant"], row["pass"], *empty, note]
    if on_gpu:
        return [row["variant"], row["pass"], _timing(row["profiler_us"]), _timing(row["graph_us"]),
                _agree(row["agree"]), _timing(row["e2e_us"]), _mib(row["peak_bytes"]), _worst_error(row),
                _ratio(row["ratio"]), _ratio(row["ratio_e2e"]), _percent(row["floor_fraction"]), note]
    return [row["variant"], row["pass"], _timing(row["e2e_us"]), _worst_error(row), _ratio(row["ratio"]),
            _percent(row["floor_fraction"]), note]


def print_tables(results: dict, console: Console) -> None:
    on_gpu = results["config"]["device"].startswith("cuda")
    for cell in cells(results):
        table = Table(title=" · ".join(cell), title_justify="left", show_lines=False)
        for name in table_columns(on_gpu):
            table.add_column(name, justify="left" if name in ("variant", "pass", "note") else "right",
                             overflow="fold")
        rows = _rows_of(results, cell)
        for i, row in enumerate(rows):
            end_section = i + 1 < len(rows) and rows[i + 1]["scope"] != row["scope"]
            style = {"error": "red", "unavailable": "dim", "skipped": "dim"}.get(row["status"])
            cells_ = (Text(c) for c in table_cells(row, on_gpu, note_width=60))  # Text: no markup in notes
            table.add_row(*cells_, style=style, end_section=end_section)
        console.print(table)
    console.print("vs best: best baseline's time / this row's (above 1 is faster); ✗: error above the dtype's "
                  "tolerance; bench/README.md explains every column.", highlight=False)


def print_summary(results: dict, console: Console) -> None:
    """A few lines to end on: msda's ratios per cell, and every row that needs a look."""
    console.print("summary: msda (the eager op) against the best baseline, device time and end-to-end", highlight=False)
    for cell in cells(results):
        parts = []
        for row in _rows_of(results, cell):
            if row["variant"] != "msda":
                continue
            if row["status"] != "ok":
                parts.append(f"{row['pass']} {row['status']}")
                continue
            parts.append(f"{row['pass']} {row['time_us']:.1f} µs, {_ratio(row['ratio'])} vs {row['best_baseline']} "
                         f"(e2e {_ratio(row['ratio_e2e'])})")
        console.print(f"  {' · '.join(cell)}: {'; '.join(parts) or 'no msda row'}", highlight=False, markup=False)
    rows = results["rows"]
    failed = [r for r in rows if r["status"] == "error"]
    wrong = [r for r in rows if r["status"] == "ok" and r["errors_ok"] is False]
    disagree = [r for r in rows if r["agree"] is False]
    for label, group in (("errors", failed), ("above tolerance", wrong), ("profiler and graph disagree", disagree)):
        if group:
            names = sorted({f"{r['variant']} {r['pass']} ({r['preset']} {r['dtype']})" for r in group})
            console.print(f"  {label}: {len(group)} rows: {', '.join(names)}", highlight=False, markup=False)
    state = "complete" if results.get("complete") else "INCOMPLETE"
    console.print(f"  {len(rows)} rows, run {state}, {results['elapsed_s']:.0f} s", highlight=False)


# --- Files -------------------------------------------------------------------------------------


def _jsonable(x):
    """Non-finite floats as strings ("inf", "nan"): JSON has no literal for them."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(results: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)  # a reader never sees half a file


def write_markdown(results: dict, path: Path) -> None:
    on_gpu = results["config"]["device"].startswith("cuda")
    lines = ["# msda bench results", ""]
    lines += [f"- {line}" for line in header_lines(results)]
    lines += [f"- {len(results['rows'])} rows in {results['elapsed_s']:.0f} s"
              + ("" if results.get("complete") else " (**incomplete run**)"), "",
              "Columns: see bench/README.md. vs best = best baseline's time / this row's (above 1 is faster); "
              "✗ = error above the dtype's tolerance; block rows' gradients are those of input_flatten, "
              "reference_points and query.", ""]
    head = table_columns(on_gpu)
    head = head[: head.index("error")] + list(ERROR_COLUMNS) + head[head.index("error") + 1:]
    for cell in cells(results):
        lines += [f"## {' · '.join(cell)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in _rows_of(results, cell):
            cells_ = table_cells(row, on_gpu)
            at = table_columns(on_gpu).index("error")
            values = list(row["errors"].values())
            if row["status"] in ("unavailable", "skipped"):
                errs = ["—"] * 4
            elif row["pass"] == "forward":
                errs = [_err(values[0] if values else None, row["tolerance"]), "—", "—", "—"]
            else:
                errs = ["—", *(_err(v, row["tolerance"]) for v in values)] + ["—"] * (3 - len(values))
            cells_ = cells_[:at] + errs + cells_[at + 1:]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells_) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def write_plot(results: dict, path: Path) -> None:
    """Time per variant (log scale), one panel per preset and pass, one bar per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    on_gpu = results["config"]["device"].startswith("cuda")
    rows = [r for r in results["rows"] if r["status"] == "ok" and r["time_us"] and r["time_us"] > 0]
    presets = list(dict.fromkeys(r["preset"] for r in results["rows"])) or ["(none)"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in results["rows"]))
    variants = list(dict.fromkeys(r["variant"] for r in rows)) or ["(none)"]  # those with a time
    passes = ("forward", "backward")
    panel_height = 1.0 + 0.12 * len(variants) * max(len(dtypes), 2)
    fig, axes = plt.subplots(len(passes), len(presets), figsize=(6.5 * len(presets), panel_height * len(passes)),
                             squeeze=False)
    height = 0.8 / max(len(dtypes), 1)
    for col, preset in enumerate(presets):
        for row_i, p in enumerate(passes):
            ax = axes[row_i][col]
            for k, dtype in enumerate(dtypes):
                ys, xs = [], []
                for v_i, v in enumerate(variants):
                    times = [r["time_us"] for r in rows if (r["preset"], r["pass"], r["dtype"], r["variant"])
                             == (preset, p, dtype, v)]
                    if times:
                        ys.append(v_i + k * height)
                        xs.append(times[0])
                ax.barh(ys, xs, height=height, label=dtype)
            ax.set_yticks([i + 0.4 - height / 2 for i in range(len(variants))], variants)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap on short axes
            ax.set_xlabel("device time, µs (profiler)" if on_gpu else "time, µs (torch.utils.benchmark)")
            ax.set_title(f"{preset} · {p}")
            ax.grid(axis="x", which="both", alpha=0.3)
            if row_i == 0 and col == 0 and dtypes:
                ax.legend()
    machine = results["machine"]
    fig.suptitle(f"msda bench · {machine['gpu'] or machine['cpu']} · torch {machine['torch']} · "
                 f"dist {', '.join(results['config']['dists'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    write_json(results, paths[0])
    write_markdown(results, paths[1])
    write_plot(results, paths[2])
    return paths


# --- Merging runs ------------------------------------------------------------------------------


def merge(runs: list[dict], labels: list[str]) -> dict:
    """One results dict from runs on one machine: a later run's cells replace an earlier run's,
    and `sources` says which run (label, date, copy bandwidth) each cell comes from. Ratios and
    floor fractions stay those of their own run: compare rows of one cell, not across cells."""
    latest = {cell: i for i, run in enumerate(runs) for cell in cells(run)}
    order = list(dict.fromkeys(cell for run in runs for cell in cells(run)))
    merged = {**runs[-1], "copy_bandwidth_GBps": None, "complete": all(r.get("complete") for r in runs),
              "elapsed_s": float(sum(r["elapsed_s"] for r in runs))}
    merged["config"] = {**runs[-1]["config"],
                        "presets": list(dict.fromkeys(p for r in runs for p in r["config"]["presets"])),
                        "dtypes": list(dict.fromkeys(d for r in runs for d in r["config"]["dtypes"]))}
    merged["rows"] = [row for cell in order for row in _rows_of(runs[latest[cell]], cell)]
    merged["sources"] = [
        {"label": label, "date": run["machine"]["date"], "copy_bandwidth_GBps": run.get("copy_bandwidth_GBps"),
         "cells": [" · ".join(cell) for cell in order if latest[cell] == i]}
        for i, (run, label) in enumerate(zip(runs, labels))
        if any(latest[cell] == i for cell in order)
    ]
    return merged


# --- Schema ------------------------------------------------------------------------------------

TOP_KEYS = {"schema": int, "machine": dict, "config": dict, "copy_bandwidth_GBps": (float, type(None)),
            "rows": list, "complete": bool, "elapsed_s": float}
TIMING = (dict, type(None))
NUMBER = (int, float, type(None))
ROW_KEYS = {
    "preset": str, "dtype": str, "dist": str, "variant": str, "scope": str, "baseline": bool, "description": str,
    "pass": str, "status": str, "note": str, "notes": list, "profiler_us": TIMING, "graph_us": TIMING,
    "agree": (bool, type(None)), "e2e_us": TIMING, "peak_bytes": (int, type(None)), "errors": dict,
    "tolerance": NUMBER, "errors_ok": (bool, type(None)), "time_us": NUMBER, "ratio": NUMBER,
    "ratio_e2e": NUMBER, "best_baseline": (str, type(None)), "min_bytes": (int, type(None)),
    "floor_fraction": NUMBER, "setup_s": NUMBER,
}


def validate(results: dict) -> list[str]:
    """Problems with the results' schema (empty when valid): keys, types, allowed values."""
    problems = []
    for key, kind in TOP_KEYS.items():
        if key not in results:
            problems.append(f"missing top-level key {key!r}")
        elif not isinstance(results[key], kind):
            problems.append(f"{key!r} is {type(results[key]).__name__}")
    for key in ("gpu", "torch", "triton", "clocks", "cpu", "peers"):
        if key not in results.get("machine", {}):
            problems.append(f"machine lacks {key!r}")
    for i, row in enumerate(results.get("rows", [])):
        for key, kind in ROW_KEYS.items():
            if key not in row:
                problems.append(f"row {i} lacks {key!r}")
            elif not isinstance(row[key], kind):
                problems.append(f"row {i} {key!r} is {type(row[key]).__name__}")
        if row.get("status") not in STATUSES:
            problems.append(f"row {i} status {row.get('status')!r}")
        if row.get("pass") not in ("forward", "backward"):
            problems.append(f"row {i} pass {row.get('pass')!r}")
        if row.get("scope") not in ("op", "block"):
            problems.append(f"row {i} scope {row.get('scope')!r}")
        for column in ("profiler_us", "graph_us", "e2e_us"):
            timing = row.get(column)
            if isinstance(timing, dict) and set(timing) != {"median", "iqr", "n"}:
                problems.append(f"row {i} {column} keys {sorted(timing)}")
        for name, value in row.get("errors", {}).items():
            if not isinstance(value, (float, str)):
                problems.append(f"row {i} error {name!r} is {type(value).__name__}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """python -m bench.report RESULTS_JSON [MORE_JSON ...] [--labels ...] [--out DIR]: render
    results.md and results.png again from a results.json (a run stopped early, or one whose report
    code has changed); given several, merge them into one results.json first, a later run's cells
    replacing an earlier's."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--labels", nargs="+", help="one per results file, e.g. the commit it ran (default: file names)")
    parser.add_argument("--out", type=Path, help="default: the first JSON's folder")
    opts = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in opts.results]
    labels = opts.labels or [str(path) for path in opts.results]
    if len(labels) != len(runs):
        parser.error(f"{len(runs)} results files but {len(labels)} labels")
    results = runs[0] if len(runs) == 1 else merge(runs, labels)
    problems = validate(results)
    if problems:
        parser.error("invalid results: " + "; ".join(problems[:5]))
    out = opts.out or opts.results[0].parent
    for path in write_all(results, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
