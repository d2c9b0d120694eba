"""The tables of a run: the machine header, a table per cell and a summary, on the terminal (rich)
and in results.md. bench/README.md explains every column.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .schema import cells, row_note, rows_of

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
LEGEND = "vs best: best baseline's time / this row's (above 1 is faster); ✗: error above the dtype's tolerance"

# --- The header ----------------------------------------------------------------------------------


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
        if m.get("clocks_after"):
            lines.append(clocks_after_line(results))
    cpu = f"CPU: {m['cpu']}" + (f", {m['cpu_count']} cores" if m.get("cpu_count") else "")
    if not m["gpu"]:  # the thread count matters only where the CPU is what is timed
        threads = m["threads"]
        cpu += f"; timed on {threads} thread{'' if threads == 1 else 's'}"
    lines.append(cpu)
    peers = ", ".join(f"{k} {v or 'not installed'}" for k, v in m["peers"].items())
    lines.append(f"python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), triton {m['triton']}, "
                 f"msda {m['msda']} (backend {m['msda_backend']}); peers: {peers}")
    lines.append(f"presets {', '.join(c['presets'])}; dtypes {', '.join(c['dtypes'])}; dist {', '.join(c['dists'])}; "
                 f"device {c['device']}; torch.compile backend {c['compile_backend']}; {m['date']}")
    if results.get("copy_bandwidth_GBps"):
        lines.append(f"copy bandwidth (read + write, measured): {results['copy_bandwidth_GBps']:.0f} GB/s")
    for source in results.get("sources", []):  # a merge of runs (bench.merge)
        bandwidth = source["copy_bandwidth_GBps"]
        lines.append(f"cells {', '.join(source['cells'])}: {source['label']} ({source['date']}"
                     + (f", copy bandwidth {bandwidth:.0f} GB/s)" if bandwidth else ")"))
    return lines


def clocks_after_line(results: dict) -> str:
    after = results["machine"].get("clocks_after") or {}
    return (f"clocks after the run: SM {after.get('clocks.sm')}, memory {after.get('clocks.mem')}, "
            f"power {after.get('power.draw')}")


def print_header(results: dict, console: Console) -> None:
    for line in header_lines(results):
        console.print(line, highlight=False, markup=False)


# --- One row as text -----------------------------------------------------------------------------


def _timing(t: dict | None) -> str:
    return "—" if t is None else f"{t['median']:.1f} ±{t['iqr']:.1f}"


def _err(value, tolerance) -> str:
    if value is None:
        return "—"
    if isinstance(value, str) or not math.isfinite(value):
        return f"{value} ✗"
    mark = " ✗" if tolerance is not None and value > tolerance else ""
    return f"{value:.1e}{mark}"


def ratio_text(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _percent(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def _agree(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "NO")


def _mib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f}"


def _sortable(v) -> float:
    return math.inf if isinstance(v, str) else v


def _worst_error(row: dict) -> str:
    """The forward's output error, or the largest gradient error with its name."""
    errors = row["errors"]
    if not errors:
        return "—"
    name, value = max(errors.items(), key=lambda kv: _sortable(kv[1]))
    text = _err(value, row["tolerance"])
    return text if row["pass"] == "forward" else f"{text} {LABELS.get(name, name)}"


def table_columns(on_gpu: bool) -> list[str]:
    if on_gpu:
        return ["variant", "pass", "profiler µs", "graph µs", "agree", "e2e µs", "peak MiB", "error", "vs best",
                "vs best e2e", "% floor", "note"]
    return ["variant", "pass", "time µs", "error", "vs best", "% floor", "note"]


def table_cells(row: dict, on_gpu: bool, note_width: int | None = None) -> list[str]:
    text = row_note(row) if row["status"] == "ok" else f"{row['status']}: {row_note(row)}"
    if note_width is not None and len(text) > note_width:
        text = text[: note_width - 1] + "…"
    if row["status"] in ("unavailable", "skipped"):
        empty = ["—"] * (len(table_columns(on_gpu)) - 3)
        return [row["variant"], row["pass"], *empty, text]
    if on_gpu:
        return [row["variant"], row["pass"], _timing(row["profiler_us"]), _timing(row["graph_us"]),
                _agree(row["agree"]), _timing(row["e2e_us"]), _mib(row["peak_bytes"]), _worst_error(row),
                ratio_text(row["ratio"]), ratio_text(row["ratio_e2e"]), _percent(row["floor_fraction"]), text]
    return [row["variant"], row["pass"], _timing(row["e2e_us"]), _worst_error(row), ratio_text(row["ratio"]),
            _percent(row["floor_fraction"]), text]


def _on_gpu(results: dict) -> bool:
    return results["config"]["device"].startswith("cuda")


# --- The terminal --------------------------------------------------------------------------------


def print_tables(results: dict, console: Console) -> None:
    on_gpu = _on_gpu(results)
    for cell in cells(results):
        table = Table(title=" · ".join(cell), title_justify="left", show_lines=False)
        for name in table_columns(on_gpu):
            table.add_column(name, justify="left" if name in ("variant", "pass", "note") else "right",
                             overflow="fold")
        rows = rows_of(results, cell)
        for i, row in enumerate(rows):
            end_section = i + 1 < len(rows) and rows[i + 1]["scope"] != row["scope"]
            style = {"error": "red", "unavailable": "dim", "skipped": "dim"}.get(row["status"])
            texts = (Text(c) for c in table_cells(row, on_gpu, note_width=60))  # Text: no markup in notes
            table.add_row(*texts, style=style, end_section=end_section)
        console.print(table)
    console.print(f"{LEGEND}; bench/README.md explains every column.", highlight=False)


def print_summary(results: dict, console: Console) -> None:
    """A few lines to end on: msda's ratios per cell, and every row that needs a look."""
    console.print("summary: msda (the eager op) against the best baseline, device time and end-to-end", highlight=False)
    for cell in cells(results):
        parts = []
        for row in rows_of(results, cell):
            if row["variant"] != "msda":
                continue
            if row["status"] != "ok":
                parts.append(f"{row['pass']} {row['status']}")
                continue
            parts.append(f"{row['pass']} {row['time_us']:.1f} µs, {ratio_text(row['ratio'])} "
                         f"vs {row['best_baseline']} (e2e {ratio_text(row['ratio_e2e'])})")
        console.print(f"  {' · '.join(cell)}: {'; '.join(parts) or 'no msda row'}", highlight=False, markup=False)
    rows = results["rows"]
    failed = [r for r in rows if r["status"] == "error"]
    wrong = [r for r in rows if r["status"] == "ok" and r["errors_ok"] is False]
    disagree = [r for r in rows if r["agree"] is False]
    for label, group in (("errors", failed), ("above tolerance", wrong), ("profiler and graph disagree", disagree)):
        if group:
            names = sorted({f"{r['variant']} {r['pass']} ({r['preset']} {r['dtype']})" for r in group})
            console.print(f"  {label}: {len(group)} rows: {', '.join(names)}", highlight=False, markup=False)
    if results["machine"].get("clocks_after"):
        console.print(f"  {clocks_after_line(results)}", highlight=False, markup=False)
    state = "complete" if results.get("complete") else "INCOMPLETE"
    console.print(f"  {len(rows)} rows, run {state}, {results['elapsed_s']:.0f} s", highlight=False)


# --- results.md ----------------------------------------------------------------------------------


def write_markdown(results: dict, path: Path) -> None:
    on_gpu = _on_gpu(results)
    lines = ["# msda bench results", ""]
    lines += [f"- {line}" for line in header_lines(results)]
    lines += [f"- {len(results['rows'])} rows in {results['elapsed_s']:.0f} s"
              + ("" if results.get("complete") else " (**incomplete run**)"), "",
              f"Columns: see bench/README.md. {LEGEND}; block rows' gradients are those of input_flatten, "
              "reference_points and query.", ""]
    columns = table_columns(on_gpu)
    at = columns.index("error")
    head = columns[:at] + list(ERROR_COLUMNS) + columns[at + 1:]
    for cell in cells(results):
        lines += [f"## {' · '.join(cell)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in rows_of(results, cell):
            texts = table_cells(row, on_gpu)
            values = list(row["errors"].values())
            if row["status"] in ("unavailable", "skipped"):
                errs = ["—"] * 4
            elif row["pass"] == "forward":
                errs = [_err(values[0] if values else None, row["tolerance"]), "—", "—", "—"]
            else:
                errs = ["—", *(_err(v, row["tolerance"]) for v in values)] + ["—"] * (3 - len(values))
            texts = texts[:at] + errs + texts[at + 1:]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in texts) + " |")
        lines.append("")
    path.write_text("\n".join(lines))
