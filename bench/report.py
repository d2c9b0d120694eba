"""The files of a run, and `python -m bench.report` to write them again from results.json.

    python -m bench.report RESULTS_JSON [MORE_JSON ...] [--labels ...] [--out DIR]

writes results.json (every number), results.md (the tables) and results.png (the speed-ups) into
DIR (default: the first JSON's folder). Given several JSON files of one machine, it merges them
first, a later run's cells replacing an earlier's (bench.merge).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .merge import merge
from .plot import write_plot
from .schema import read_json, validate, write_json
from .tables import write_markdown


def write_all(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    write_json(results, paths[0])
    write_markdown(results, paths[1])
    write_plot(results, paths[2])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--labels", nargs="+",
                        help="one per results file, e.g. the commit it ran (default: file names)")
    parser.add_argument("--out", type=Path, help="default: the first JSON's folder")
    opts = parser.parse_args(argv)
    runs = [read_json(path) for path in opts.results]
    labels = opts.labels or [str(path) for path in opts.results]
    if len(labels) != len(runs):
        parser.error(f"{len(runs)} results files but {len(labels)} labels")
    results = runs[0] if len(runs) == 1 else merge(runs, labels)
    problems = validate(results)
    if problems:
        parser.error("invalid results: " + "; ".join(problems[:5]))
    for path in write_all(results, opts.out or opts.results[0].parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
