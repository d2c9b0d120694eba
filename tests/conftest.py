"""Test configuration: which tier runs, Triton's interpreter on CPU-only machines, hypothesis."""

import os

import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before
# triton is imported (msda imports it). With a GPU they are compiled and tests/gpu runs too.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    collect_ignore = ["gpu"]

from hypothesis import HealthCheck, settings  # noqa: E402

# The interpreter is slow and the first call of a shape compiles: no per-example deadline.
settings.register_profile("default", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
