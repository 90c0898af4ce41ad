"""Approximations computed by the special-function unit (SFU)."""
from __future__ import annotations

import numpy as np
from numba import types

from ._asm import _F32, _asm, _f32, _is_number, simulated_by


def _sim_exp2_approx(x):
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.float32(np.exp2(np.float32(x)))


@simulated_by(_sim_exp2_approx)
def exp2_approx(typingctx, x):
    """x -> float32 ``2**x`` on the SFU, subnormals flushed (``exp2(-inf) = 0``)::

        ex2.approx.ftz.f32 d, x;"""
    if not _is_number(x):
        return None
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        return _asm(builder, _F32, [_F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                    [_f32(context, builder, args[0], sig.args[0])])

    return sig, codegen


def _sim_tanh_approx(x):
    return np.float32(np.tanh(np.float32(x)))


@simulated_by(_sim_tanh_approx)
def tanh_approx(typingctx, x):
    """x -> float32 ``tanh(x)`` on the SFU (sm_75+; the PTX ISA gives a maximum relative error of about 2^-11, so
    for float16 / bfloat16 work; ``tanh(+-inf) = +-1``, NaN stays NaN)::

        tanh.approx.f32 d, x;"""
    if not _is_number(x):
        return None
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        return _asm(builder, _F32, [_F32], "tanh.approx.f32 $0, $1;", "=f,f",
                    [_f32(context, builder, args[0], sig.args[0])])

    return sig, codegen
