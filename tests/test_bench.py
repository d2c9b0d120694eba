"""The bench (python -m bench): its timing helpers, its bookkeeping, its results' layout, merging
runs, the plot, and the smoke preset end to end on a CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import model, schema, tables
from bench import run as bench_run
from bench.__main__ import config_from, parse_args
from bench.merge import merge
from bench.phases import by_name, per_launch
from bench.timing import AGREEMENT, Timing, agree, device_events_us
from bench.tune import _list_tile, _tiles, backward_launch
from bench.variants import (
    PRESETS, SMOKE, VARIANTS, Cell, _autograd_case, _msda_autograd, _msda_op, _reference, grid_sample_msda,
)
from msda.kernels.launch import TileConfig, backward_config
from msda.testing import TOLERANCE, Shape, make_inputs, reference, reference_with_grads, relative_error

REPO = Path(__file__).resolve().parents[1]
CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(device_type, elapsed_us):
    return SimpleNamespace(device_type=device_type, time_range=SimpleNamespace(elapsed_us=lambda: elapsed_us))


def test_device_events_us_sums_the_device_events_only():
    events = [_event(CUDA, 12.5), _event(CPU, 1000.0), _event(CUDA, 7.5), _event(CPU, 3.0)]
    assert device_events_us(events) == 20.0
    assert device_events_us([]) == 0
    assert device_events_us([_event(CPU, 5.0)]) == 0


def test_agree_is_symmetric_within_ten_percent_of_the_smaller():
    assert AGREEMENT == 0.10
    assert agree(100.0, 110.0) and agree(110.0, 100.0)
    assert not agree(100.0, 110.5) and not agree(110.5, 100.0)
    assert agree(50.0, 50.0)
    assert not agree(0.0, 1.0)


def test_timing_reports_median_and_interquartile_range():
    t = Timing(samples_us=[1.0, 2.0, 3.0, 4.0, 100.0])
    assert t.median_us == 3.0
    assert t.iqr_us == 2.0  # inclusive quartiles 2 and 4: the outlier does not move them
    assert Timing(samples_us=[5.0]).iqr_us == 0.0


def test_a_backward_derived_as_step_minus_forward_is_positive_or_missing():
    """(forward+backward) - forward: published where positive; where the two timings' noise is
    larger than their difference (a host under load), no number, and the row says why."""
    row = {"notes": []}
    difference = bench_run._minus(row, "timer", Timing(samples_us=[30.0, 32.0, 34.0]), Timing(samples_us=[10.0]))
    assert difference.samples_us == [20.0, 22.0, 24.0] and row["notes"] == []
    assert bench_run._minus(row, "timer", Timing(samples_us=[9.0, 10.0]), Timing(samples_us=[12.0])) is None
    assert row["notes"] == ["timer: (forward+backward) - forward is -2.5 us: within the timings' noise"]
    assert bench_run._minus(row, "e2e", None, Timing(samples_us=[1.0])) is None


def test_memory_floor_counts_each_input_and_output_once():
    shape = SMOKE  # B=2, Q=12, M=2, D=8, levels 6x8 and 3x4 (S=60), K=2
    value, out = 2 * 60 * 2 * 8 * 4, 2 * 12 * 2 * 8 * 4
    loc, attn = 2 * 12 * 2 * 2 * 2 * 2 * 4, 2 * 12 * 2 * 2 * 2 * 4
    meta = 2 * 2 * 8 + 2 * 8
    forward = model.min_bytes(shape, torch.float32, torch.float32, "forward")
    backward = model.min_bytes(shape, torch.float32, torch.float32, "backward")
    assert forward == value + loc + attn + meta + out
    assert backward == out + value + loc + attn + meta + value + loc + attn
    half = model.min_bytes(shape, torch.float16, torch.float32, "forward")
    assert half == (value + out) // 2 + loc + attn + meta
    assert model.floor_fraction(4000, 4e9, 2.0) == pytest.approx(0.5)  # 1 us at the floor, measured 2 us


@pytest.mark.parametrize("dist", ["uniform", "local"])
def test_grid_sample_baseline_computes_msda(dist):
    inputs = make_inputs(SMOKE, torch.float64, dist=dist, outside_fraction=0.1, seed=3)
    shapes = [tuple(hw) for hw in inputs.spatial_shapes.tolist()]
    actual = grid_sample_msda(inputs.value, shapes, inputs.sampling_locations, inputs.attention_weights)
    expected = reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def test_cli_defaults_and_filters_on_a_cpu():
    config = config_from(parse_args(["--device", "cpu"]))
    assert config.presets == ["smoke"] and config.dtypes == ["float32"] and config.dists == ["uniform"]
    assert config.compile_backend == "aot_eager" and config.threads == 1
    assert [v.name for v in config.variants] == [v.name for v in VARIANTS]  # every peer by default

    config = config_from(parse_args(["--device", "cpu", "--preset", "all", "--dtype", "float16,bfloat16",
                                     "--dtype", "float32", "--dist", "local", "--peers", "--variants", "msda*"]))
    assert config.presets == list(PRESETS)
    assert config.dtypes == ["float16", "bfloat16", "float32"] and config.dists == ["local"]
    assert [v.name for v in config.variants] == ["msda", "msda-deterministic", "msda-no-shared-tile", "msda-autograd",
                                                 "msda-autograd-no-starts", "msda-graph"]
    assert not any(v.peer for v in config_from(parse_args(["--device", "cpu", "--peers"])).variants)
    with pytest.raises(SystemExit):
        config_from(parse_args(["--device", "cpu", "--dtype", "float8"]))
    # A peer named with --peers whose variants --variants filters out: an error, not a bench without it.
    with pytest.raises(SystemExit, match="--peers deformops, but --variants matches none"):
        config_from(parse_args(["--device", "cpu", "--variants", "msda", "--peers", "deformops"]))
    config = config_from(parse_args(["--device", "cpu", "--variants", "msda", "deformops", "--peers", "deformops"]))
    assert [v.name for v in config.variants] == ["msda", "deformops"]


def test_a_cpu_backward_derived_under_load_is_measured_again(monkeypatch):
    """On a CPU, where a spell of load leaves (forward+backward) - forward at or under zero, the
    bench measures more rounds of turns, every sample kept, before it calls the difference noise:
    the smoke bench failed that way beside the GPU tier's concurrent processes."""
    loaded = {"forward": 2}  # the forward's first two turns run under load: 100 us instead of 10
    samples = {"forward": [], "step": []}

    def cpu_time(fn, threads, min_run_time):
        name = "forward" if fn is case.forward else "step"
        slow = name == "forward" and loaded["forward"] > 0
        loaded["forward"] -= slow
        samples[name].append(100.0 if slow else (10.0 if name == "forward" else 30.0))
        return Timing([samples[name][-1]])

    monkeypatch.setattr(bench_run, "cpu_time", cpu_time)
    case = SimpleNamespace(forward=object(), step=object(), backward=None)
    variant = next(v for v in VARIANTS if v.name == "msda")
    rows = {p: bench_run._row({}, variant, p, "ok", "") for p in schema.PASSES}
    bench_run._time_cpu(case, rows, threads=1, min_run_time=0.3)
    bwd = rows["backward"]
    assert len(samples["forward"]) == 2 * bench_run.CPU_TURNS  # one round more, then the difference is positive
    assert bwd["e2e_us"]["median"] == pytest.approx(20.0)  # the step's 30 less the forward's median, 10
    assert "backward = (forward+backward) - forward, 2 rounds" in bwd["notes"]

    loaded["forward"] = 10**6  # under load throughout: noise after CPU_DERIVED_ROUNDS rounds, no number
    samples = {"forward": [], "step": []}
    rows = {p: bench_run._row({}, variant, p, "ok", "") for p in schema.PASSES}
    bench_run._time_cpu(case, rows, threads=1, min_run_time=0.3)
    assert len(samples["forward"]) == bench_run.CPU_DERIVED_ROUNDS * bench_run.CPU_TURNS
    assert rows["backward"]["e2e_us"] is None
    assert any("within the timings' noise" in n for n in rows["backward"]["notes"])


def test_cuda_bookkeeping_with_stand_in_timers(monkeypatch):
    """The GPU path's arithmetic, on a CPU: the timers are replaced by ones that return a fixed
    time per callable (forward 10, backward 20, forward+backward 30 us; graph replay 5% more)."""
    inputs = make_inputs(SMOKE, torch.float32, seed=0)
    grad = torch.randn(2, 12, 16)
    cell = Cell("smoke", SMOKE, torch.float32, "uniform", torch.device("cpu"), inputs, grad, "eager", {})
    cases = {"msda": _msda_op(cell), "autograd": _msda_autograd(cell), "compiled": _reference(cell, compiled=True)}
    times = {}
    for case in cases.values():
        times[case.forward] = 10.0
        times[case.step] = 30.0
        if case.backward is not None:
            times[case.backward] = 20.0

    monkeypatch.setattr(bench_run, "_counts", lambda fn: (3, 5))
    monkeypatch.setattr(bench_run, "profiler_device_time", lambda fn, calls, repeats: Timing([times[fn]] * repeats))
    monkeypatch.setattr(bench_run, "graph_device_time", lambda fn, calls, replays: Timing([times[fn] * 1.05] * 3))
    monkeypatch.setattr(bench_run, "end_to_end_time", lambda fn, calls, repeats: Timing([times[fn] * 2] * repeats))
    monkeypatch.setattr(bench_run, "peak_memory_bytes", lambda fn: int(times[fn]) * 1000)

    for name, case in cases.items():
        variant = next(v for v in VARIANTS if v.name == "msda")
        rows = {p: bench_run._row({}, variant, p, "ok", "") for p in schema.PASSES}
        bench_run._time_cuda(case, rows)
        fwd, bwd = rows["forward"], rows["backward"]
        assert fwd["profiler_us"]["median"] == 10.0 and fwd["graph_us"]["median"] == pytest.approx(10.5)
        assert fwd["e2e_us"]["median"] == 20.0 and fwd["peak_bytes"] == 10000 and fwd["agree"] is True
        assert bwd["profiler_us"]["median"] == pytest.approx(20.0), name
        assert bwd["graph_us"]["median"] == pytest.approx(21.0), name  # direct, or step minus forward
        assert bwd["e2e_us"]["median"] == pytest.approx(40.0), name
        assert bwd["agree"] is True, name
        if name == "autograd":
            assert "graph: (forward+backward) - forward" in bwd["notes"]
        if name == "compiled":
            assert bwd["peak_bytes"] == 30000 and any("(forward+backward) - forward" in n for n in bwd["notes"])


def test_autograd_case_keeps_no_forward_alive_when_the_step_is_captured(monkeypatch):
    """An autograd variant's backward() reuses one forward; it is dropped before step() is
    captured (its leaves' AccumulateGrad nodes, made on the default stream, would make the
    default stream wait inside the capture and invalidate it), and made again when needed."""
    leaf = torch.randn(3, requires_grad=True)
    made = []

    def call():
        out = leaf * 2
        made.append(weakref.ref(out))
        return out

    case = _autograd_case(call, (leaf,), torch.ones(3))
    alive_at_capture = []

    def graph_device_time(fn, calls, replays):
        alive_at_capture.append(any(ref() is not None for ref in made))
        return Timing([1.0] * 3)

    monkeypatch.setattr(bench_run, "_counts", lambda fn: (3, 5))
    monkeypatch.setattr(bench_run, "profiler_device_time", lambda fn, calls, repeats: Timing([1.0] * repeats))
    monkeypatch.setattr(bench_run, "graph_device_time", graph_device_time)
    monkeypatch.setattr(bench_run, "end_to_end_time", lambda fn, calls, repeats: Timing([1.0] * repeats))
    monkeypatch.setattr(bench_run, "peak_memory_bytes", lambda fn: 0)
    variant = next(v for v in VARIANTS if v.name == "msda-autograd")
    rows = {p: bench_run._row({}, variant, p, "ok", "") for p in schema.PASSES}
    bench_run._time_cuda(case, rows)
    assert alive_at_capture == [True, False]  # the forward's capture, then the step's
    assert torch.equal(case.backward()[0], torch.full((3,), 2.0))  # a forward made again


def test_ratios_use_the_fastest_baseline_within_tolerance():
    def row(variant, baseline, time_us, ok=True):
        r = bench_run._row({}, next(v for v in VARIANTS if v.name == variant), "forward", "ok", "")
        r.update(baseline=baseline, time_us=time_us, e2e_us={"median": 2 * time_us, "iqr": 0.0, "n": 1},
                 errors_ok=ok)
        return r

    rows = [row("msda", False, 10.0), row("reference", True, 40.0), row("reference-compile", True, 20.0),
            row("deformops", True, 5.0, ok=False)]  # fastest, but wrong: not the yardstick
    bench_run._rank(rows)
    assert rows[0]["ratio"] == 2.0 and rows[0]["best_baseline"] == "reference-compile"
    assert rows[0]["ratio_e2e"] == 2.0
    assert rows[1]["ratio"] == 0.5 and rows[3]["ratio"] == 4.0


def test_op_rows_are_judged_against_the_bound_and_block_rows_are_not():
    errors = {"output": 2e-5}
    assert bench_run.judge_errors("op", torch.float32, errors) == (TOLERANCE[torch.float32], False)
    assert bench_run.judge_errors("op", torch.float16, errors) == (TOLERANCE[torch.float16], True)
    assert bench_run.judge_errors("block", torch.float32, errors) == (None, None)


def test_validate_reports_schema_problems():
    assert "missing top-level key 'rows'" in schema.validate({})
    results = {"schema": 1, "machine": {"gpu": None, "torch": "x", "triton": None, "clocks": None, "cpu": "c",
                                        "peers": {}},
               "config": {}, "copy_bandwidth_GBps": 1.0, "rows": [], "complete": True, "elapsed_s": 1.0}
    assert schema.validate(results) == []
    row = bench_run._row({"preset": "smoke", "dtype": "float32", "dist": "uniform"}, VARIANTS[0], "forward", "ok", "")
    assert schema.validate({**results, "rows": [row]}) == []
    assert schema.validate({**results, "rows": [{**row, "status": "fine"}]}) == ["row 0 status 'fine'"]
    assert schema.validate({**results, "rows": [{**row, "e2e_us": {"median": 1.0}}]})


def test_a_row_has_the_keys_that_validate_checks():
    """The row layout is written once (bench.schema.ROW): rows are built from it, checked by it."""
    row = bench_run._row({"preset": "smoke", "dtype": "float32", "dist": "uniform"}, VARIANTS[0], "backward",
                         "error", "why")
    assert list(row) == list(schema.ROW)
    assert (row["variant"], row["pass"], row["status"], row["note"]) == ("msda", "backward", "error", "why")
    assert row["notes"] == [] and row["notes"] is not schema.new_row()["notes"]  # a fresh list each
    with pytest.raises(KeyError):
        schema.new_row(colour="red")


def test_the_committed_results_are_valid():
    results = schema.read_json(REPO / "bench" / "results" / "results.json")
    assert schema.validate(results) == []


def test_plot_spread_and_the_note_for_what_did_not_run():
    from bench import plot

    timing = lambda median, iqr: {"median": median, "iqr": iqr, "n": 5}  # noqa: E731
    base = schema.new_row(variant="reference", profiler_us=timing(100.0, 20.0), time_us=100.0, ratio=1.0,
                          best_baseline="reference")
    row = schema.new_row(variant="msda", profiler_us=timing(10.0, 2.0), time_us=10.0, ratio=10.0,
                         best_baseline="reference")
    assert plot._spread(row, base) == pytest.approx((90 / 11, 110 / 9))
    assert plot._spread(base, base) == (1.0, 1.0)
    skipped = schema.new_row(variant="msda-graph", status="skipped", note="needs CUDA")
    assert plot._not_run(skipped) == "did not run (skipped): needs CUDA"


def test_merge_takes_each_cell_from_the_latest_run_that_has_it():
    def run(date, cells, bandwidth):
        rows = [bench_run._row({"preset": p, "dtype": d, "dist": "uniform"}, VARIANTS[0], "forward", "ok", date)
                for p, d in cells]
        machine = {"gpu": "g", "torch": "x", "triton": "t", "clocks": None, "cpu": "c", "peers": {}, "date": date,
                   "threads": 1, "python": "3", "cuda": "13", "msda": "0", "msda_backend": "auto"}
        config = {"presets": sorted({p for p, _ in cells}), "dtypes": sorted({d for _, d in cells}),
                  "dists": ["uniform"], "device": "cuda:0", "compile_backend": "inductor"}
        return {"schema": 1, "machine": machine, "config": config,
                "copy_bandwidth_GBps": bandwidth, "rows": rows, "complete": True, "elapsed_s": 2.0}

    old = run("monday", [("decoder", "float32"), ("decoder", "float16"), ("encoder", "float32")], 4100.0)
    new = run("tuesday", [("encoder", "float32")], 4200.0)
    merged = merge([old, new], ["a", "b"])
    assert schema.validate(merged) == []
    assert [(r["preset"], r["dtype"], r["note"]) for r in merged["rows"]] == [
        ("decoder", "float32", "monday"), ("decoder", "float16", "monday"), ("encoder", "float32", "tuesday")]
    assert [(s["label"], s["cells"]) for s in merged["sources"]] == [
        ("a", ["decoder · float32 · uniform", "decoder · float16 · uniform"]),
        ("b", ["encoder · float32 · uniform"])]
    assert merged["copy_bandwidth_GBps"] is None and merged["elapsed_s"] == 4.0
    assert merged["config"]["presets"] == ["decoder", "encoder"]
    assert "cells encoder · float32 · uniform: b (tuesday, copy bandwidth 4200 GB/s)" in tables.header_lines(merged)


def test_smoke_preset_end_to_end(tmp_path):
    """The acceptance check of the bench issue: the smoke preset on a CPU writes the three files,
    with eager and compiled rows, the reference rows and the error columns, all correct."""
    out, trace = tmp_path / "out", tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--preset", "smoke", "--device", "cpu", "--out", str(out),
         "--trace", str(trace)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).stat().st_size > 0, name
    assert list(trace.glob("trace_smoke_float32_uniform.json"))

    results = json.loads((out / "results.json").read_text())
    assert schema.validate(results) == []
    assert results["complete"] and results["config"]["device"] == "cpu"
    rows = {(r["variant"], r["pass"]): r for r in results["rows"]}
    for variant in ("msda", "msda-autograd", "msda-autograd-no-starts", "reference", "reference-compile", "block",
                    "block-compile", "block-unfused", "block-unfused-compile"):
        for p in ("forward", "backward"):
            r = rows[variant, p]
            # (pytest cuts a long dict short: the fields that say why come first)
            assert r["status"] == "ok", (variant, p, r["status"], r["note"], r["notes"])
            assert r["e2e_us"]["median"] > 0 and r["time_us"] > 0 and r["ratio"] > 0
            assert r["errors"] and all(e <= TOLERANCE[torch.float32] for e in r["errors"].values()), r
    assert set(rows["msda", "forward"]["errors"]) == {"output"}
    assert set(rows["msda", "backward"]["errors"]) == {
        "grad_value", "grad_sampling_locations", "grad_attention_weights"
    }
    assert rows["msda", "forward"]["floor_fraction"] > 0
    for variant in ("msda-graph", "block-reduce-overhead"):
        assert rows[variant, "forward"]["status"] == "skipped"
    for peer in ("deformops", "mmcv", "block-deformops"):
        assert rows[peer, "forward"]["status"] in ("ok", "unavailable", "error")
        assert rows[peer, "forward"]["note"] or rows[peer, "forward"]["status"] == "ok"
    markdown = (out / "results.md").read_text()
    assert "| msda | forward |" in markdown and "err ∂loc/∂ref" in markdown
    assert proc.stdout.count("CPU: ") == 1, proc.stdout  # the machine, once
    assert "1 threads" not in proc.stdout and "timed on 1 thread" in proc.stdout

    # python -m bench.report renders the markdown and the plot again from the JSON alone.
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(out / "results.json"), "--out", str(again)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (again / "results.md").read_text() == markdown
    assert (again / "results.png").stat().st_size > 0


@pytest.mark.transformers
def test_detr_preset_runs_stock_and_patched():
    """bench.detr builds a transformers Deformable DETR twice, patches one with msda, and times
    both (a tiny model on CPU here): every eager row has both times and a speed-up."""
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-m", "bench.detr", "--smoke", "--no-compile", "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("│ inference", "│ training"))]
    assert len(rows) == 4 and not any("failed" in row for row in rows), result.stdout
    assert all(row.rstrip("│ ").endswith("x") for row in rows), result.stdout


def test_detr_preset_rows_picked_and_written(tmp_path):
    """bench.detr's --modes, --precisions and --kinds pick the rows (one here), and --out writes
    them under the machine's description; an unknown choice is an argparse error naming it."""
    pytest.importorskip("transformers")
    out = tmp_path / "detr.md"
    command = [sys.executable, "-m", "bench.detr", "--smoke", "--modes", "eager", "--device", "cpu"]
    result = subprocess.run([*command, "--precisions", "float32", "--kinds", "inference", "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("│ inference", "│ training"))]
    assert len(rows) == 1 and "float32" in rows[0], result.stdout
    written = [line for line in out.read_text().splitlines() if line.startswith("| inference")]
    assert len(written) == 1 and written[0].endswith("x |") and "- torch: " in out.read_text()
    bad = subprocess.run([*command, "--kinds", "inference,testing"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--kinds: testing is not one of inference, training" in bad.stderr
    bad = subprocess.run([*command, "--modes", "graphed"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--modes: graphed is not one of eager, compiled" in bad.stderr


def test_tune_tiles_positional_and_named():
    """bench.tune's tile strings: positional fields in TileConfig's order, then name=value ones;
    anything else is an argparse error naming the string."""
    assert _tiles("16,2,0") == TileConfig(16, 2, 0)
    assert _tiles("16,2,0,0,1,1,1,2,40") == TileConfig(16, 2, 0, 0, True, True, True, 2, 40)
    named = _tiles("16,2,0,lane_placement=1,lane_unroll=2,max_registers=40")
    assert named == TileConfig(16, 2, 0, lane_placement=True, lane_unroll=2, max_registers=40)
    for bad in ("16,2,0,lanes=1", "16,2,lane_unroll=2,0", "16,x,0", "16,2,0,block_q=8", "16"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            _tiles(bad)


def test_tune_list_tiles():
    """bench.tune --lists: rows and entries, optionally the counters' spacing, the gather's
    warps, whether it joins a row's runs and whether the lists are sorted (0 or 1 each)."""
    assert _list_tile("4,2") == (4, 2) and _list_tile("8,2,1") == (8, 2, 1)
    assert _list_tile("16,2,1,1") == (16, 2, 1, 1) and _list_tile("32,1,1,1,0") == (32, 1, 1, 1, 0)
    assert _list_tile("32,1,1,1,1,1") == (32, 1, 1, 1, 1, 1)
    for bad in ("4", "4,x", "0,2", "1,2,3,4,5", "1,2,3,4,1,2", "1,2,3,4,1,1,1"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            _list_tile(bad)


@pytest.mark.parametrize("fresh", [False, True], ids=["reused", "fresh"])
def test_tune_backward_buffers(fresh):
    """bench.tune's backward launch (Triton's interpreter here): its gradients match the oracle
    on every call; with fresh buffers each call sums into a grad_value of its own (as the
    operator's calls and the bench's graph replay), else into the one it returned."""
    shape = Shape(batch=1, queries=3, heads=2, head_dim=4, levels=((3, 4), (2, 2)), points=2)
    inputs = make_inputs(shape, torch.float32, "cuda" if torch.cuda.is_available() else "cpu", seed=88)
    grad = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(89)).to(inputs.value.device)
    expected = reference_with_grads(inputs, grad)[1:]
    run, grads = backward_launch(inputs, grad, backward_config(2, 2, 4, torch.float32), fresh=fresh)
    first = grads[0]
    for _ in range(2):
        run()
        for got, want in zip(grads, expected):
            assert relative_error(got, want) <= TOLERANCE[torch.float32]
    assert (grads[0] is not first) == fresh


def test_phases_sums_by_name_or_lists_each_launch():
    """bench.phases: kernel times summed by name a call, or each launch of a call in order (the
    median over the calls); calls that launched different kernels are refused."""
    kernels = [("count", 2.0), ("fill", 5.0), ("count", 4.0), ("fill", 7.0), ("count", 3.0), ("fill", 6.0)]
    assert by_name(kernels, 3) == [("fill", 6.0), ("count", 3.0)]
    assert per_launch(kernels, 3) == [("count", 3.0), ("fill", 6.0)]
    with pytest.raises(RuntimeError, match="not the same launches"):
        per_launch(kernels[:5], 3)
    with pytest.raises(RuntimeError, match="not the same launches"):
        per_launch([("count", 1.0), ("fill", 1.0), ("fill", 1.0), ("count", 1.0)], 2)


def test_calls_rows_run_and_differentiate_on_a_cpu():
    from bench.calls import rows

    shape = Shape(batch=2, queries=5, heads=2, head_dim=4, levels=((4, 6), (2, 3)), points=2)
    table = rows(shape, torch.float32, chain=3, device="cpu")
    assert "msda x 3, one backward, per call" in table
    for name, (call, backward) in table.items():
        result = call()
        if backward and not name.startswith("trivial"):
            layers = 3 if "x 3" in name else 1  # a chain's calls each have leaves of their own
            assert [g.shape for g in result] == layers * [
                torch.Size([2, 30, 2, 4]), torch.Size([2, 5, 2, 2, 2, 2]), torch.Size([2, 5, 2, 2, 2])
            ], name  # fmt: skip
