"""Input handling shared by the reference functions.

Everything in ``reference`` computes in float64 so that it can serve as the
ground truth for lower-precision GPU kernels; the helpers here convert the
inputs, apply the ``(seqlen, headdim)`` <-> ``(batch, heads, seqlen, headdim)``
convention, and reject bad arguments with a ValueError that names the argument.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "ArgumentTypeError",
    "check_flag",
    "check_real",
    "to_float64",
    "to_float64_shaped",
    "check_positive_int",
    "prepare_qkv",
    "resolve_sm_scale",
    "kv_head_for_q_head",
    "finish",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a flag that is not a bool, a number that is not a real number.

    A ``TypeError``, and a ``ValueError`` like every other bad argument here. ``numba_attn`` raises its own class
    of the same name and bases for the same mistakes."""


def check_flag(value, name: str) -> bool:
    """``value`` as a bool: ``True``, ``False`` or a NumPy bool. Any other value (``"no"``, ``1``, None) is a
    mistake, never taken for its truth value."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ArgumentTypeError(f"{name} must be True or False; got {value!r}")


def check_real(value, name: str, allow_none: bool = False):
    """``value`` as a float if it is a real number (not a bool, not a string); None passes when allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a real number{' or None' if allow_none else ''}; got {value!r}")
    return float(value)


def to_float64(x, name: str) -> np.ndarray:
    """Return ``x`` as a float64 array; reject non-real input naming ``name``."""
    array = np.asarray(x)
    # bool and complex inputs are almost certainly mistakes for attention inputs.
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a real numeric array; got dtype {array.dtype}")
    return array.astype(np.float64, copy=False)


def to_float64_shaped(x, name: str, shape: tuple, meaning: str) -> np.ndarray:
    """``x`` as a float64 array of exactly ``shape``; a ValueError naming ``name`` and ``meaning`` otherwise.

    For arrays whose shape follows from the other arguments (a gradient of the output, a saved ``lse``);
    ``meaning`` says where the shape comes from, e.g. ``"the output's shape"``.
    """
    array = to_float64(x, name)
    if array.shape != tuple(shape):
        raise ValueError(f"{name} must have {meaning} {tuple(shape)}; got shape {array.shape}")
    return array


def check_positive_int(value, name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1, else raise ValueError naming it."""
    # bool is an Integral in Python, but block_m=True is never what the caller meant.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value}")
    return int(value)


def prepare_qkv(q, k, v):
    """Validate attention inputs and bring them to ``(batch, heads, seqlen, headdim)``.

    Accepts either all-rank-4 ``(batch, heads, seqlen, headdim)`` inputs or
    all-rank-2 ``(seqlen, headdim)`` inputs (treated as batch = heads = 1).
    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention) as
    long as ``q``'s head count is a multiple of theirs.

    Returns ``(q, k, v, unbatched)`` with float64 rank-4 arrays; ``unbatched``
    tells :func:`finish` to drop the two leading axes again.
    """
    q = to_float64(q, "q")
    k = to_float64(k, "k")
    v = to_float64(v, "v")
    for name, array in (("q", q), ("k", k), ("v", v)):
        if array.ndim not in (2, 4):
            raise ValueError(
                f"{name} must have shape (batch, heads, seqlen, headdim) or (seqlen, headdim); "
                f"got shape {array.shape}"
            )
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(
            f"q, k and v must have the same rank; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    unbatched = q.ndim == 2
    if unbatched:
        q, k, v = q[None, None], k[None, None], v[None, None]

    batch, heads_q, _, headdim = q.shape
    if headdim < 1:
        raise ValueError(f"q must have headdim >= 1; got shape {q.shape}")
    for name, array in (("k", k), ("v", v)):
        if array.shape[0] != batch:
            raise ValueError(f"{name} has batch {array.shape[0]} but q has batch {batch}")
        if array.shape[3] != headdim:
            raise ValueError(f"{name} has headdim {array.shape[3]} but q has headdim {headdim}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has seqlen {v.shape[2]} but k has seqlen {k.shape[2]}")
    heads_kv = k.shape[1]
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) "
            "for grouped-query attention"
        )
    return q, k, v, unbatched


def resolve_sm_scale(sm_scale, headdim: int) -> float:
    """The softmax scale: ``1/sqrt(headdim)`` unless the caller chose one (a finite real number)."""
    if sm_scale is None:
        return 1.0 / np.sqrt(headdim)
    scale = check_real(sm_scale, "sm_scale")
    if not np.isfinite(scale):
        raise ValueError(f"sm_scale must be finite; got {sm_scale!r}")
    return scale


def kv_head_for_q_head(heads_q: int, heads_kv: int) -> np.ndarray:
    """Index array mapping each query head ``h`` to its key/value head ``h // (Hq // Hkv)``."""
    group_size = heads_q // heads_kv
    return np.arange(heads_q) // group_size


def finish(array: np.ndarray, unbatched: bool, dtype, leading: int = 0) -> np.ndarray:
    """Undo the unbatched expansion and cast to the requested dtype (float64 by default).

    ``leading`` counts axes in front of ``(batch, heads, ...)`` (the split axis of
    the split-KV parts), which must be kept when dropping batch and heads.
    """
    if unbatched:
        index = (slice(None),) * leading + (0, 0)
        array = array[index]
    return np.asarray(array, dtype=np.float64 if dtype is None else dtype)
