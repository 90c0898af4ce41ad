"""Test setup: GPU-or-simulator decision, Hypothesis profiles, the `gpu` marker.

Importing numba_attn first lets it decide, before numba.cuda is imported, whether kernels run on a GPU or under
Numba's CUDA simulator (no GPU visible -> NUMBA_ENABLE_CUDASIM=1). Tests marked `gpu` need real hardware and
are skipped under the simulator.
"""
import os

# small test grids are meant to be small: no occupancy warnings for them
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

import numba_attn  # noqa: F401  (must come before any numba.cuda import)
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if not numba_attn.SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (running under the Numba CUDA simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output and scratch array of a call starts as NaN: an element a kernel leaves unwritten, or scratch read
    before it is written, shows as NaN (the poisoned-output pattern for functions that allocate their outputs)."""
    import numpy as np

    from numba_attn.runtime import arrays

    output, scratch = arrays.Call.output, arrays.Call.scratch

    def poison(view):
        # Numba device arrays take a scalar through full slices, not through an Ellipsis; integer scratch is an
        # index table: a wrong index shows too
        view[(slice(None),) * len(view.shape)] = np.nan if np.dtype(view.dtype).kind == "f" else -12345

    def poisoned_output(self, *args, **kwargs):
        result = output(self, *args, **kwargs)
        poison(result.view)
        return result

    def poisoned_scratch(self, *args, **kwargs):
        view = scratch(self, *args, **kwargs)
        poison(view)
        return view

    monkeypatch.setattr(arrays.Call, "output", poisoned_output)
    monkeypatch.setattr(arrays.Call, "scratch", poisoned_scratch)
