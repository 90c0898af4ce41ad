"""Soft-capping of the scores (FlashAttention's ``softcap``, as in Gemma 2), shared by every forward kernel.

With ``softcap = c`` a score is ``c tanh(sm_scale q.k / c)`` before the softmax (``reference._masks.cap_scores``), and
the lse is that of the capped scores. The kernels take ``sm_scale / c`` as their score-scale argument
(``kernel_scale``; otherwise ``sm_scale log2 e``), use ``y = tanh(q.k * (sm_scale / c))`` as the softmax's score and
multiply it by the compile-time ``c log2 e`` (``cap_post``) where the exponent meets it -- the same fold as the
uncapped ``sm_scale log2 e``, but positive whatever the sign of ``sm_scale``, so a capped kernel never scales first.
``c`` is a compile-time constant of the kernel (``forward.common.Variant``): one specialisation per value, as models
use one or two. A raw score of ``+-inf`` is capped to ``+-c`` (finite, as in the reference); NaN stays NaN; masked
keys are set to ``-inf`` after the cap.

``score_cap(softcap, precise)`` is the device function: ``math.tanh`` (libdevice, about 2 ulp: the float32 kernels)
or ``ptx.tanh_approx`` (one SFU instruction, relative error about 2^-11: the float16 / bfloat16 kernels, as
FlashAttention does).
"""
from __future__ import annotations

import math

import numpy as np

from . import ptx
from .constants import LOG2E
from .staging import device_function


def cap_post(softcap: float) -> np.float32:
    """What a capped score ``y`` is multiplied by inside the exponent: ``c log2 e`` (base 2)."""
    return np.float32(softcap * LOG2E)


def kernel_scale(sm_scale: float, softcap: float | None) -> tuple:
    """``(scale, scale_first)``: the kernels' float32 score-scale argument and whether the scores must be scaled
    before the running max. Without a cap ``(sm_scale log2 e, sm_scale <= 0)``; with one ``(sm_scale / c, False)``.
    ValueError when the capped scale or ``c log2 e`` is not a finite float32 (a ``softcap`` far too small or large)."""
    if softcap is None:
        return np.float32(sm_scale * LOG2E), not sm_scale > 0
    with np.errstate(over="ignore", under="ignore"):
        scale, post = np.float32(sm_scale / softcap), cap_post(softcap)
    if not (np.isfinite(scale) and np.isfinite(post) and post > 0):
        raise ValueError(f"softcap: {softcap!r} with sm_scale {sm_scale!r}: sm_scale / softcap and softcap * log2(e) "
                         "must be finite nonzero float32 numbers")
    return scale, False


def _identity(x, scale):
    return x


def score_cap(softcap: float | None, precise: bool):
    """``cap(x, scale) -> tanh(x * scale)`` in float32 (``precise``: ``math.tanh``, else ``tanh.approx``); for no
    cap a never-called identity, so that kernels can name it in a branch their compile-time flag removes."""
    if softcap is None:
        return device_function(_identity)
    tanh = math.tanh if precise else ptx.tanh_approx

    @device_function
    def cap(x, scale):
        return tanh(x * scale)

    return cap
