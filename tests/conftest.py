"""Test configuration: which tier runs, Triton's interpreter on CPU-only machines, hypothesis."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before
# triton is imported (msda imports it). With a GPU they are compiled and tests/gpu runs too.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    collect_ignore = ["gpu"]

from hypothesis import HealthCheck, settings  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter drops launch keywords its kernel does not take; a compiled launch rejects
    # them. Reject them here too, so that a constexpr left in a launch after the kernel lost it
    # fails the CPU tier, not only the sm_90 compile check (bench/NOTES.md entry 39).
    import inspect  # noqa: E402

    from triton.runtime import interpreter  # noqa: E402

    _LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
    _interpreted_launch = interpreter.GridExecutor.__call__

    def _strict_launch(self, *args, **kwargs):
        unknown = set(kwargs) - set(inspect.getfullargspec(self.fn).args) - _LAUNCH_OPTIONS
        if unknown:
            raise TypeError(f"{self.fn.__name__} takes no argument {sorted(unknown)}")
        return _interpreted_launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = _strict_launch

# AOTAutograd's on-disk cache keys a compiled graph on the graph dynamo traced and the source of
# the Triton kernels in it, not on the Python body of msda's operators, which AOTAutograd traces
# into the graph: a graph compiled from another version of msda (another checkout sharing the
# cache directory) would be reused. Inductor's own cache, keyed on the traced graph, stays on.
import torch._functorch.config  # noqa: E402

torch._functorch.config.enable_autograd_cache = False

# The interpreter is slow and the first call of a shape compiles: no per-example deadline.
settings.register_profile("default", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for one test."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# The sm_90 compile check (tests/test_kernels_compile.py) compiles about a thousand kernels in a
# subprocess: minutes on one core. In one test process it starts as soon as the tests are chosen,
# runs beside the others on another core, and its test waits for it. Not in pytest-xdist's workers
# (each would start its own; under `-n` the worker that takes its test starts it and waits, while
# the other workers go on), nor on a one-core machine.
COMPILE_CHECK_TEST = "test_kernels_compile.py::test_kernels_compile_for_hopper"
_early_compile_check = pytest.StashKey[tuple]()


def compile_check_process() -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """scripts/compile_check.py running in a subprocess (TRITON_INTERPRET unset: it compiles),
    and the file its output goes to."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    output = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, str(root / "scripts" / "compile_check.py")], env=env, stdout=output, stderr=subprocess.STDOUT
    )
    return process, output


@pytest.hookimpl(trylast=True)  # after --deselect and -k have chosen
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput") or (os.cpu_count() or 1) < 2:
        return
    if any(item.nodeid.endswith(COMPILE_CHECK_TEST) for item in items):
        config.stash[_early_compile_check] = compile_check_process()


def pytest_unconfigure(config):
    """A compile check whose test never ran (-x, an interrupt) does not outlive the session."""
    process, _ = config.stash.get(_early_compile_check, (None, None))
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture
def compile_check(request) -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """The compile check's process and output file: the one started with the session, else a new one."""
    early = request.config.stash.get(_early_compile_check, None)
    return early if early is not None else compile_check_process()
