"""The layout of results.json, written once: the top-level keys, a row's keys with their types and
defaults, the check of both (`validate`), and reading and writing the file.

bench/README.md describes every key.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

SCHEMA = 1
STATUSES = ("ok", "error", "unavailable", "skipped")
PASSES = ("forward", "backward")
SCOPES = ("op", "block")

_TIMING = (dict, type(None))  # {"median", "iqr", "n"} in µs, or None
_NUMBER = (int, float, type(None))
_OPTIONAL_STR = (str, type(None))

TOP = {
    "schema": int,
    "machine": dict,
    "config": dict,
    "copy_bandwidth_GBps": (float, type(None)),
    "rows": list,
    "complete": bool,
    "elapsed_s": float,
}
MACHINE_KEYS = ("gpu", "torch", "triton", "clocks", "cpu", "peers")

# A row: key -> (allowed types, default). new_row() builds rows from it, validate() checks them.
ROW = {
    "preset": (str, ""),
    "dtype": (str, ""),
    "dist": (str, ""),
    "variant": (str, ""),
    "scope": (str, "op"),
    "baseline": (bool, False),
    "description": (str, ""),
    "pass": (str, "forward"),
    "status": (str, "ok"),
    "note": (str, ""),
    "notes": (list, []),
    "profiler_us": (_TIMING, None),
    "graph_us": (_TIMING, None),
    "agree": ((bool, type(None)), None),
    "e2e_us": (_TIMING, None),
    "peak_bytes": ((int, type(None)), None),
    "errors": (dict, {}),
    "tolerance": (_NUMBER, None),
    "errors_ok": ((bool, type(None)), None),
    "time_us": (_NUMBER, None),
    "ratio": (_NUMBER, None),
    "ratio_e2e": (_NUMBER, None),
    "best_baseline": (_OPTIONAL_STR, None),
    "min_bytes": ((int, type(None)), None),
    "floor_fraction": (_NUMBER, None),
    "setup_s": (_NUMBER, None),
}
TIMING_KEYS = {"median", "iqr", "n"}
# The columns time_us is taken from, in order: device time (profiler, else graph replay) on a GPU,
# the torch.utils.benchmark time (stored as e2e_us) on a CPU.
PRIMARY_TIMINGS = ("profiler_us", "graph_us", "e2e_us")


def new_row(**values) -> dict:
    """A row with every key of ROW: `values` where given, the defaults elsewhere."""
    unknown = set(values) - set(ROW)
    if unknown:
        raise KeyError(f"not row keys: {sorted(unknown)}")
    return {key: values[key] if key in values else copy.deepcopy(default) for key, (_, default) in ROW.items()}


def new_results(machine: dict, config: dict) -> dict:
    """The results of a run before its first cell."""
    return {
        "schema": SCHEMA,
        "machine": machine,
        "config": config,
        "copy_bandwidth_GBps": None,
        "rows": [],
        "complete": False,
        "elapsed_s": 0.0,
    }


def cells(results: dict) -> list[tuple[str, str, str]]:
    """(preset, dtype, dist) of every cell, in the order of the rows."""
    return list(dict.fromkeys((r["preset"], r["dtype"], r["dist"]) for r in results["rows"]))


def rows_of(results: dict, cell: tuple[str, str, str]) -> list[dict]:
    return [r for r in results["rows"] if (r["preset"], r["dtype"], r["dist"]) == cell]


def row_note(row: dict) -> str:
    """The row's note and notes, in one line."""
    return "; ".join(n for n in [row["note"], *row["notes"]] if n)


def primary_timing(row: dict) -> dict | None:
    """The timing that time_us is the median of (see PRIMARY_TIMINGS), or None."""
    return next((row[key] for key in PRIMARY_TIMINGS if row.get(key) is not None), None)


def validate(results: dict) -> list[str]:
    """Problems with the results' layout (empty when valid): keys, types, allowed values."""
    problems = []
    for key, kind in TOP.items():
        if key not in results:
            problems.append(f"missing top-level key {key!r}")
        elif not isinstance(results[key], kind):
            problems.append(f"{key!r} is {type(results[key]).__name__}")
    for key in MACHINE_KEYS:
        if key not in results.get("machine", {}):
            problems.append(f"machine lacks {key!r}")
    for i, row in enumerate(results.get("rows", [])):
        for key, (kind, _) in ROW.items():
            if key not in row:
                problems.append(f"row {i} lacks {key!r}")
            elif not isinstance(row[key], kind):
                problems.append(f"row {i} {key!r} is {type(row[key]).__name__}")
        for key, allowed in (("status", STATUSES), ("pass", PASSES), ("scope", SCOPES)):
            if row.get(key) not in allowed:
                problems.append(f"row {i} {key} {row.get(key)!r}")
        for column in PRIMARY_TIMINGS:
            timing = row.get(column)
            if isinstance(timing, dict) and set(timing) != TIMING_KEYS:
                problems.append(f"row {i} {column} keys {sorted(timing)}")
        for name, value in row.get("errors", {}).items():
            if not isinstance(value, (float, str)):
                problems.append(f"row {i} error {name!r} is {type(value).__name__}")
    return problems


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


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
