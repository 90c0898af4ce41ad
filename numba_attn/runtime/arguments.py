"""Checks of the public functions' scalar arguments: flags are ``bool``, numbers are real numbers, in one place.

Rule: an argument of the wrong type raises ``ArgumentTypeError`` (a ``TypeError``; also a ``ValueError``, which
these checks raised before they told the two apart), a value out of range raises ``ValueError``; every message
starts with the argument's name. ``True`` is no number and ``1`` no flag: ``causal="no"`` or ``sm_scale=True``
are mistakes, never silently taken for ``True`` or ``1.0``. NumPy's bools and real scalars are accepted.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..core.constants import LOG2E


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a flag that is not a bool, a number that is not a real number)."""


def check_flag(value, name: str) -> bool:
    """``value`` as a bool: ``True``, ``False`` or a NumPy bool, nothing else."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ArgumentTypeError(f"{name}: expected True or False, got {value!r}")


def check_real(value, name: str) -> float:
    """``value`` as a float: a real number (int, float, NumPy integer or float, Fraction...), not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a real number, got {value!r}")
    return float(value)


def check_sm_scale(sm_scale) -> float | None:
    """The caller's score scale as a float (None: the default ``1 / sqrt(headdim)``, decided later).

    The kernels fold ``log2(e)`` into the scale in float32 (``exp2`` of scaled scores): a scale whose float32
    product is not finite (``|sm_scale| >= 2.4e38``) would turn every row into NaN, so it is refused."""
    if sm_scale is None:
        return None
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, numbers.Real):
        raise ArgumentTypeError(f"sm_scale: expected a finite real number or None, got {sm_scale!r}")
    scale = float(sm_scale)
    if not math.isfinite(scale):
        raise ValueError(f"sm_scale: expected a finite real number or None, got {sm_scale!r}")
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(scale * LOG2E)):
            raise ValueError(f"sm_scale: {sm_scale!r} is too large: the kernels compute sm_scale * log2(e) in "
                             "float32, where it overflows")
    return scale


def check_eps(eps) -> float:
    """``linear_attention``'s ``eps``: a real number >= 0, finite in float32 (the kernels add it in float32)."""
    value = check_real(eps, "eps")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(value)):
            raise ValueError(f"eps: {eps!r} is too large: the kernels add it in float32, where it overflows")
    return value


def check_num_splits(num_splits) -> int | None:
    """``flash_decode``'s ``num_splits``: None or an integer >= 1 (a Python or NumPy integer, not a bool)."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise ArgumentTypeError(f"num_splits: expected an integer >= 1 or None, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected an integer >= 1 or None, got {num_splits!r}")
    return int(num_splits)


def check_window(window) -> tuple | None:
    """``flash_forward``'s ``window``: None (no window) or a ``(left, right)`` tuple of ints >= 0 or None (unbounded
    on that side), as ``reference``'s ``check_window``: a tuple or list of two entries, each None or a Python or
    NumPy integer >= 0, not a bool (``-1`` is no way to say "unbounded": None is)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)):
        raise ArgumentTypeError(f"window: expected None or a (left, right) tuple, got {window!r}")
    if len(window) != 2:
        raise ValueError(f"window: expected two entries (left, right), got {window!r}")
    for side, value in zip(("left", "right"), window):
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ArgumentTypeError(f"window: {side} must be an int >= 0 or None (unbounded), got {value!r}")
        if value < 0:
            raise ValueError(f"window: {side} must be an int >= 0 or None (unbounded), got {value!r}")
    return tuple(None if value is None else int(value) for value in window)


def check_softcap(softcap) -> float | None:
    """``flash_forward``'s ``softcap``: None or 0 (no capping, as ``reference``'s ``check_softcap``) or a finite real
    number > 0, as a float (not a bool)."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(f"softcap: expected a finite number > 0 or None, got {softcap!r}")
    value = float(softcap)
    if value == 0:
        return None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap: expected a finite number > 0 or None (None or 0: no capping), got {softcap!r}")
    return value


def check_backend(backend, backends: tuple) -> str | None:
    """``backend``: None or one of ``backends`` (the family's dispatch says which apply to the call)."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise ArgumentTypeError(f"backend: expected one of {', '.join(backends)} or None, got {backend!r}")
    if backend not in backends:
        raise ValueError(f"backend: expected one of {', '.join(backends)} or None, got {backend!r}")
    return str(backend)
