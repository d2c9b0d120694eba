"""results.png: how much faster each variant is than the best baseline of its cell.

One panel per scope (op rows, then block rows), pass and preset; in each, a bar per variant and
dtype from 1x to its speed-up (the best baseline's time over the variant's: to the right is faster)
on a log axis, whiskers from the spread of both times, the value written beside the bar, a
diamond where the row is the baseline itself, hatching where the row's error is above the dtype's
tolerance, and a note in place of the bar where the variant did not run.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from .schema import PASSES, SCOPES, primary_timing, row_note

SLOT_INCHES = 0.46  # height of one variant's group of bars
PANEL_EXTRA_INCHES = 1.0  # title and axis labels of a panel
TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
FINE_TICKS = (0.3, 0.4, 0.6, 0.7, 0.8, 1.25, 1.5, 3, 4)  # added where an axis spans less than ~10x
FONT = 7


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = results["rows"]
    presets = list(dict.fromkeys(r["preset"] for r in rows)) or ["(no rows)"]
    many_dists = len({r["dist"] for r in rows}) > 1
    series = list(dict.fromkeys(_series(r, many_dists) for r in rows))
    colors = {s: f"C{i}" for i, s in enumerate(series)}
    scopes = [s for s in SCOPES if any(r["scope"] == s for r in rows)] or ["op"]
    variants = {s: list(dict.fromkeys(r["variant"] for r in rows if r["scope"] == s)) for s in scopes}
    panel_rows = [(scope, p) for scope in scopes for p in PASSES]
    heights = [SLOT_INCHES * max(len(variants[scope]), 1) + PANEL_EXTRA_INCHES for scope, _ in panel_rows]

    machine, on_gpu = results["machine"], results["config"]["device"].startswith("cuda")
    timed = "device time (profiler)" if on_gpu else "time per call (torch.utils.benchmark)"
    title = (f"msda bench · {machine['gpu'] or machine['cpu']} · torch {machine['torch']} · "
             f"triton {machine['triton']} · {', '.join(results['config']['dists'])} locations")
    sources = results.get("sources") or []
    subtitle = (f"speed-up = the best baseline's {timed} / the variant's, per cell; right of 1× is faster. "
                "Whiskers: the interquartile ranges of both times. Op rows against the fastest baseline within "
                "tolerance (reference, reference-compile, peers), block rows against the faster of the eager "
                "block with a separate softmax (block-unfused) and with the peer's fused one (block-deformops)."
                + (f" Cells from {len(sources)} runs (results.md says which)." if len(sources) > 1 else ""))
    width = max(7.5 * len(presets), 9.0)
    subtitle_lines = textwrap.wrap(subtitle, int(15 * width))
    header = 0.45 + 0.17 * len(subtitle_lines) + 0.35  # inches: title, subtitle, legend
    fig = plt.figure(figsize=(width, sum(heights) + header + 0.5))
    inches = fig.get_figheight()
    grid = fig.add_gridspec(len(panel_rows), len(presets), height_ratios=heights, hspace=0.55, wspace=0.32,
                            left=1.7 / width, right=1 - 0.3 / width, top=1 - (header + 0.3) / inches,
                            bottom=0.5 / inches)
    for i, (scope, pass_) in enumerate(panel_rows):
        for j, preset in enumerate(presets):
            ax = fig.add_subplot(grid[i, j])
            group = [r for r in rows if (r["scope"], r["pass"], r["preset"]) == (scope, pass_, preset)]
            _panel(ax, group, variants[scope], series, colors, many_dists)
            ax.set_title(f"{scope} · {preset} · {pass_}", fontsize=FONT + 3, loc="left")

    fig.text(0.01, 1 - 0.2 / inches, title, fontsize=FONT + 5, va="top")
    fig.text(0.01, 1 - 0.5 / inches, "\n".join(subtitle_lines), fontsize=FONT + 1, va="top")
    handles = [Patch(color=colors[s], label=s) for s in series]
    handles += [
        Patch(facecolor="white", edgecolor="0.3", hatch="////", label="error above the dtype's tolerance (✗)"),
        Line2D([], [], marker="D", color="0.2", linestyle="none", markersize=5, label="the best baseline (1×)"),
    ]
    fig.legend(handles=handles, loc="upper left", ncol=len(handles), fontsize=FONT + 1, frameon=False,
               bbox_to_anchor=(0.005, 1 - (header - 0.3) / inches))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series(row: dict, many_dists: bool) -> str:
    return f"{row['dtype']} {row['dist']}" if many_dists else row["dtype"]


def _panel(ax, group: list[dict], variants: list[str], series: list[str], colors: dict, many_dists: bool) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    height = 0.8 / max(len(series), 1)
    by_key = {(r["variant"], _series(r, many_dists)): r for r in group}
    spans, bars, notes = [1.0], [], []
    for v_i, variant in enumerate(variants):
        for s_i, name in enumerate(series):
            row = by_key.get((variant, name))
            if row is None:
                continue
            y = v_i + (s_i - (len(series) - 1) / 2) * height
            if row["status"] != "ok" or not row["ratio"]:
                notes.append((v_i, y, _not_run(row)))
                continue
            baseline = by_key.get((row["best_baseline"], name))
            low, high = _spread(row, baseline)
            spans += [low, high]
            bars.append((y, row, low, high, colors[name]))

    low_limit = min(spans) / 1.8
    high_limit = max(spans) * 1.8
    for y, row, low, high, color in bars:
        ratio = row["ratio"]
        wrong = row["errors_ok"] is False
        is_baseline = row["variant"] == row["best_baseline"]
        if is_baseline:
            ax.plot([1], [y], marker="D", color="0.2", markersize=4, zorder=3)
        else:
            ax.barh(y, abs(ratio - 1), left=min(ratio, 1), height=height * 0.92, color=color,
                    hatch="////" if wrong else None, edgecolor="0.25" if wrong else color, linewidth=0.4)
        if high > low:
            ax.errorbar(ratio, y, xerr=[[ratio - low], [high - ratio]], fmt="none", ecolor="0.15",
                        elinewidth=0.8, capsize=1.8, zorder=4)
        label = ("baseline" if is_baseline else _times(ratio)) + (" ✗" if wrong else "")
        right = ratio >= 1
        ax.annotate(label, (high if right else low, y), xytext=(3 if right else -3, 0), textcoords="offset points",
                    ha="left" if right else "right", va="center", fontsize=FONT)
    # What did not run, in its variant's slot (one line where every dtype has the same reason).
    for v_i in dict.fromkeys(v for v, _, _ in notes):
        lines = [(y, text) for v, y, text in notes if v == v_i]
        if len({text for _, text in lines}) == 1:
            lines = [(v_i, lines[0][1])]
        for y, text in lines:
            ax.text(0.01, y, text, transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=FONT,
                    color="0.3", style="italic", clip_on=True)

    ax.set_xscale("log")
    ax.set_xlim(low_limit, high_limit)
    ticks = [t for t in TICKS if low_limit <= t <= high_limit]
    if high_limit / low_limit < 10:
        ticks = sorted(ticks + [t for t in FINE_TICKS if low_limit <= t <= high_limit])
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}×"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis="x", labelsize=FONT + 1)
    ax.axvline(1, color="0.3", linewidth=0.8)
    ax.set_yticks(range(len(variants)), variants, fontsize=FONT + 2)
    ax.set_ylim(len(variants) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    best = {_series(r, many_dists): r["best_baseline"] for r in group if r["best_baseline"]}
    named = ", ".join(dict.fromkeys(best.values())) if len(set(best.values())) == 1 else \
        ", ".join(f"{s}: {b}" for s, b in best.items())
    ax.set_xlabel("× faster than the best baseline" + (f" ({named})" if named else ""), fontsize=FONT + 1)


def _spread(row: dict, baseline: dict | None) -> tuple[float, float]:
    """The speed-up's range from the interquartile ranges of the baseline's time and the row's."""
    ratio, mine = row["ratio"], primary_timing(row)
    if baseline is None or baseline is row or mine is None or primary_timing(baseline) is None:
        return ratio, ratio
    theirs = primary_timing(baseline)
    t, dt = mine["median"], mine["iqr"] / 2
    b, db = theirs["median"], theirs["iqr"] / 2
    if t - dt <= 0 or b - db <= 0:
        return ratio, ratio
    return min(ratio, (b - db) / (t + dt)), max(ratio, (b + db) / (t - dt))


def _times(ratio: float) -> str:
    return f"{ratio:.0f}×" if ratio >= 9.95 else f"{ratio:.2f}×" if ratio >= 0.1 else f"{ratio:.3f}×"


def _not_run(row: dict) -> str:
    why = row_note(row) or "no time"
    text = f"did not run ({row['status']}): {why}" if row["status"] != "ok" else f"no ratio: {why}"
    return text if len(text) <= 90 else text[:89] + "…"
