"""Test configuration: which tier runs, Triton's interpreter on CPU-only machines, hypothesis."""

import os

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
