"""How a public call is served: one at a time under the simulator, replayed from a recorded plan where one fits,
and whether torch inputs ask for autograd. Shared by ``api`` and the family front ends (``linear.api``)."""
from __future__ import annotations

import functools

from . import autotune as _autotune
from . import replay as _replay
from .device import SIMULATOR
from .launch import SIMULATOR_LOCK


def one_call_at_a_time_under_the_simulator(fn):
    """Under the simulator, one public call runs at a time in the process (``launch.SIMULATOR_LOCK``): while a
    simulated kernel runs, its module's ``cuda`` is the simulator's fake module, so a call in another thread that
    builds a kernel there would fail. The simulator runs one kernel at a time anyway. On a GPU: ``fn`` itself."""
    if not SIMULATOR:
        return fn

    @functools.wraps(fn)
    def serialised(*args, **kwargs):
        with SIMULATOR_LOCK:
            return fn(*args, **kwargs)

    return serialised


def served(name: str, arrays: tuple, options: tuple, checked):
    """A call with torch or CuPy arrays replayed from the plan its first call of this kind recorded
    (``runtime.replay``); otherwise ``checked()``, recorded into a plan where it can be."""
    if _autotune.mode() == _autotune.TUNE:  # (a plan would skip the tuning the caller asks for)
        return checked()
    key, plan, layouts = _replay.find(name, arrays, options)
    if plan is not None:
        result = plan.run(layouts)
        if result is not None:
            return result
    return _replay.record(key, arrays, layouts, checked)


def wants_grad(*arrays) -> bool:
    """Torch tensors of which one requires grad (None entries ignored)."""
    return type(arrays[0]).__module__.startswith("torch") and any(
        getattr(x, "requires_grad", False) for x in arrays if x is not None)
