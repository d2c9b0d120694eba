"""One results dict from several runs on one machine (python -m bench.report A.json B.json ...)."""

from __future__ import annotations

from .schema import cells, rows_of


def merge(runs: list[dict], labels: list[str]) -> dict:
    """A later run's cells replace an earlier run's, and `sources` says which run (label, date,
    copy bandwidth) each cell comes from. Ratios and floor fractions stay those of their own run:
    compare rows of one cell, not across cells."""
    latest = {cell: i for i, run in enumerate(runs) for cell in cells(run)}
    order = list(dict.fromkeys(cell for run in runs for cell in cells(run)))
    merged = {**runs[-1], "copy_bandwidth_GBps": None, "complete": all(r.get("complete") for r in runs),
              "elapsed_s": float(sum(r["elapsed_s"] for r in runs))}
    merged["config"] = {**runs[-1]["config"],
                        "presets": list(dict.fromkeys(p for r in runs for p in r["config"]["presets"])),
                        "dtypes": list(dict.fromkeys(d for r in runs for d in r["config"]["dtypes"]))}
    merged["rows"] = [row for cell in order for row in rows_of(runs[latest[cell]], cell)]
    merged["sources"] = [
        {"label": label, "date": run["machine"]["date"], "copy_bandwidth_GBps": run.get("copy_bandwidth_GBps"),
         "cells": [" · ".join(cell) for cell in order if latest[cell] == i]}
        for i, (run, label) in enumerate(zip(runs, labels))
        if any(latest[cell] == i for cell in order)
    ]
    return merged
