"""scripts/gpu_session.sh on a CPU: its parts and its pytest options, with python3, nvidia-smi and
compute-sanitizer replaced by stand-ins that log their arguments (nothing runs on a GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# python3's stand-in: `-m pytest` passes, `-c "import MODULE"` fails for the modules in
# $MISSING_MODULES, everything else succeeds.
PYTHON3 = """#!/usr/bin/env bash
echo "python3 $*" >> "$STAND_IN_LOG"
if [ "$1" = -c ]; then
  for m in $MISSING_MODULES; do [ "$2" = "import $m" ] && exit 1; done
fi
[ "$1 $2" = "-m pytest" ] && echo "3 passed in 0.01s"
exit 0
"""
LOGGER = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STAND_IN_LOG"
"""


def run_session(
    tmp_path: Path, *parts: str, missing: str = "", sanitizer: str = LOGGER
) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("python3", PYTHON3), ("nvidia-smi", LOGGER), ("compute-sanitizer", sanitizer)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "STAND_IN_LOG": str(log), "MISSING_MODULES": missing}
    proc = subprocess.run(["bash", str(SCRIPT), *parts], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def pytest_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("python3 -m pytest")]


def test_default_runs_the_tier_and_the_bench(tmp_path):
    proc, calls = run_session(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unknown part" not in proc.stdout
    assert "== tier exit 0" in proc.stdout and "== bench exit 0" in proc.stdout
    groups = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("== ") and " after " in line]
    assert sorted(groups) == sorted(["gpu_bad_input", "gpu_graphs", "gpu_numerics", "gpu_contract", "gpu_fuzz",
                                     "rest", "sanitize"])  # each group reported once, as it ends
    runs = pytest_calls(calls)
    assert len(runs) == 6  # five GPU groups and the rest of the tests
    assert all("--timeout=" in c for c in runs)
    rest = next(c for c in runs if "--ignore=tests/gpu" in c)
    assert "-n 6" in rest and "--timeout=1200" in rest
    gpu_files = {f for c in runs for f in c.split() if f.startswith("tests/gpu/test_")}
    every = {f"tests/gpu/{p.name}" for p in (Path(__file__).parent / "gpu").glob("test_*.py")}
    assert gpu_files == every  # the tier runs every GPU test file
    assert any(c.startswith("compute-sanitizer --tool memcheck") for c in calls)
    assert any(c.startswith("compute-sanitizer --tool racecheck") and c.endswith("--shared-tile-only") for c in calls)
    assert any(c.startswith(f"python3 -m bench --out {tmp_path / 'out' / 'bench'}") for c in calls)
    assert (tmp_path / "out" / "rest.log").read_text().strip() == "3 passed in 0.01s"


def test_without_xdist_and_pytest_timeout_the_tier_still_runs(tmp_path):
    proc, calls = run_session(tmp_path, "tier", missing="xdist pytest_timeout")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest-xdist is not installed" in proc.stdout and "pytest-timeout is not installed" in proc.stdout
    runs = pytest_calls(calls)
    assert len(runs) == 6 and not any("-n 6" in c or "--timeout" in c for c in runs)
    assert not any("-m bench" in c for c in calls)


def test_a_failing_group_fails_the_tier(tmp_path):
    proc, _ = run_session(tmp_path, "tier", sanitizer="#!/usr/bin/env bash\nexit 9\n")
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert "== sanitize exit 9 after" in proc.stdout and "== tier exit 9" in proc.stdout
    assert "== gpu_numerics exit 0 after" in proc.stdout  # the others still reported


def test_parts_run_in_order_and_an_unknown_part_fails(tmp_path):
    proc, calls = run_session(tmp_path, "tests:tests/gpu/test_gpu_export.py", "mod:bench.tune", "nonsense")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown part nonsense" in proc.stdout
    python = [c for c in calls if c.startswith("python3 -m")]
    assert python[0].startswith("python3 -m pytest tests/gpu/test_gpu_export.py")
    assert python[1] == "python3 -m bench.tune"
