"""Benchmark msda against the pure-PyTorch reference and its peers (the method: docs/benchmarking.md).

    python -m bench                                   # GPU: decoder + encoder, 3 dtypes; CPU: smoke
    python -m bench --preset smoke --device cpu --out /tmp/bench
    python -m bench --preset encoder --dtype bfloat16 --dist local --variants 'msda*' reference
    python -m bench --trace /tmp/trace                # Chrome/Perfetto traces, one per cell

Each cell (preset x dtype x dist) gets a table: a row per variant and pass, with device time
(profiler and CUDA-graph replay), end-to-end time, peak memory, the errors against the float64
oracle, the ratio to the best baseline and the fraction of the memory floor. bench/README.md
says how to read them.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

import torch
from rich.console import Console

from .report import write_all
from .run import Config, new_results, run
from .schema import write_json
from .tables import print_summary, print_tables
from .variants import DISTS, DTYPES, PEERS, PRESETS, VARIANTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", nargs="+", action="extend", choices=[*PRESETS, "all"],
                        help="shapes (default: decoder encoder on a GPU, smoke on a CPU); all = every preset")
    parser.add_argument("--dtype", nargs="+", action="extend", metavar="DTYPE",
                        help=f"one or more of {', '.join(DTYPES)}, repeated or comma-separated "
                             "(default: all three on a GPU, float32 on a CPU)")
    parser.add_argument("--dist", nargs="+", action="extend", choices=DISTS,
                        help="distribution of the sampling locations (default: uniform)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=None,
                        help="peers to include (default: every peer; a missing one is a row saying why); "
                             "--peers with no name: none")
    parser.add_argument("--variants", nargs="+", metavar="PATTERN",
                        help="only the variants whose names match these shell patterns (e.g. 'msda*' reference)")
    parser.add_argument("--out", type=Path, help="write results.json (during the run too), results.md, results.png")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="write a torch.profiler Chrome/Perfetto trace of a few steps per cell into DIR")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of the compiled rows (default: inductor on a GPU, "
                             "aot_eager on a CPU, where inductor's C++ build takes a minute or more)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch.utils.benchmark (default: 1 for the smoke preset alone, "
                             "else torch.get_num_threads())")
    parser.add_argument("--list-variants", action="store_true", help="list the variants and exit")
    return parser.parse_args(argv)


def config_from(opts: argparse.Namespace) -> Config:
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    presets = opts.preset or (["decoder", "encoder"] if on_gpu else ["smoke"])
    if "all" in presets:
        presets = list(PRESETS)
    dtypes = [d for item in (opts.dtype or []) for d in item.split(",") if d]
    dtypes = dtypes or (list(DTYPES) if on_gpu else ["float32"])
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtype {', '.join(unknown)}: choose from {', '.join(DTYPES)}")

    peers = PEERS if opts.peers is None else opts.peers
    variants = [v for v in VARIANTS if not v.peer or v.peer in peers]
    if opts.variants:
        variants = [v for v in variants if any(fnmatch.fnmatchcase(v.name, p) for p in opts.variants)]
        if not variants:
            raise SystemExit(f"no variant matches {opts.variants}: see --list-variants")
        # `--peers NAME` asks for that peer's rows: say so if --variants leaves none of them,
        # rather than run a bench without the comparison it was started for.
        left_out = [peer for peer in opts.peers or [] if not any(v.peer == peer for v in variants)]
        if left_out:
            names = ", ".join(v.name for v in VARIANTS if v.peer in left_out)
            raise SystemExit(f"--peers {' '.join(left_out)}, but --variants matches none of its variants ({names})")

    return Config(
        presets=list(dict.fromkeys(presets)),
        dtypes=list(dict.fromkeys(dtypes)),
        dists=list(dict.fromkeys(opts.dist or ["uniform"])),
        device=device,
        variants=variants,
        compile_backend=opts.compile_backend or ("inductor" if on_gpu else "aot_eager"),
        # Tiny shapes run fastest (and steadiest) on one thread; real ones get every core.
        threads=opts.threads or (1 if presets == ["smoke"] else torch.get_num_threads()),
        trace=opts.trace,
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    console = Console(highlight=False)
    if not console.is_terminal:  # a log file: wide tables rather than folded ones
        console = Console(highlight=False, width=max(console.width, 200))
    if opts.list_variants:
        for v in VARIANTS:
            console.print(f"{v.name:22s} {v.scope:5s} {'baseline' if v.baseline else '        '} {v.description}")
        return 0
    config = config_from(opts)
    checkpoint = None
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        checkpoint = lambda results: write_json(results, opts.out / "results.json")  # noqa: E731
    results = new_results(config)
    try:
        run(config, results, console, checkpoint)
    finally:
        # Whatever was measured is shown and written, even when the run stops early. (The machine
        # was printed first; the summary adds the clocks after the run.)
        print_tables(results, console)
        print_summary(results, console)
        if opts.out is not None:
            for path in write_all(results, opts.out):
                console.print(f"wrote {path}", markup=False)
    return 0 if results["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
