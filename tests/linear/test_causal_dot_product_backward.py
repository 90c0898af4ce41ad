"""numba_attn.causal_dot_product_backward on the recurrent walks (``backend="recurrent"``,
``linear/recurrent_backward.py``) against reference.causal_dot_product_backward (float64); the chunked backend's
tests are in test_linear_backward.py.

Tiny shapes run under the CUDA simulator (heads 2, seqlen 1..20, E, M 4..16, E != M; the simulator's 4 "SMs" make
every walk split its state's columns over two blocks by default, and one test forces one and three); the `gpu` tests run realistic sizes on real hardware only. The error metric
is ‖g − ref‖ / ‖ref‖ per gradient (kernel_checks.TOLERANCE); float16 is compared with the float64 gradients of the
float16-rounded inputs.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error, to_host
from numba_attn.linear import recurrent_backward as _rb

#: the function under test, on the recurrent walks (``backend=None`` would take the chunked kernels for states)
_backward = functools.partial(numba_attn.causal_dot_product_backward, backend="recurrent")


def _case(seed, shape, e, m, dtype, with_initial_state, with_dstate):
    """``(dout, q, k, v, initial_state, dstate)``: inputs rounded to ``dtype``, float32 states (or None);
    ``shape``: the leading axes and seqlen."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal(shape + (e,)).astype(dtype) for _ in range(2))
    v, dout = (rng.standard_normal(shape + (m,)).astype(dtype) for _ in range(2))
    state_shape = shape[:-1] + (e, m)
    initial_state = rng.standard_normal(state_shape).astype(np.float32) if with_initial_state else None
    dstate = rng.standard_normal(state_shape).astype(np.float32) if with_dstate else None
    return dout, q, k, v, initial_state, dstate


def _check(grads, dout, q, k, v, initial_state, dstate, dtype):
    refs = reference.causal_dot_product_backward(dout, q, k, v, initial_state=initial_state, dstate=dstate)
    assert len(grads) == len(refs) == (3 if initial_state is None else 4)
    names = ("dq", "dk", "dv", "dinitial_state")
    likes = (q, k, v, initial_state)
    for name, g, ref, like in zip(names, grads, refs, likes):
        g = to_host(g)
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert not np.isnan(g).any(), f"{name} has NaN"
        err = rel_error(g, ref)
        # dinitial_state is float32 whatever the inputs; its inputs (q, dout) are rounded, its sum is float32
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


# (seqlen, E, M, dtype, initial_state, dstate)
CASES = [
    (1, 4, 4, "float32", False, False),  # one row
    (7, 4, 8, "float32", True, True),
    (13, 8, 4, "float16", True, False),
    (20, 16, 16, "float32", False, True),
    (11, 16, 5, "float16", True, True),
    (9, 6, 12, "float32", True, False),
]


@pytest.mark.parametrize("seqlen,e,m,dtype,with_initial_state,with_dstate", CASES)
def test_equals_reference(seqlen, e, m, dtype, with_initial_state, with_dstate):
    arrays = _case(seqlen * 100 + e * 10 + m, (1, 2, seqlen), e, m, dtype, with_initial_state, with_dstate)
    dout, q, k, v, initial_state, dstate = arrays
    grads = _backward(dout, q, k, v, initial_state=initial_state, dstate=dstate)
    _check(grads, *arrays, dtype)


@pytest.mark.parametrize("m_splits", [1, 3])
def test_forced_column_split(m_splits):
    """Each walk's state columns in one block, or asked in three (E = 7, M = 6: the dv walk gets three blocks of 2
    columns, the dq and dk walks two of 4 and 3: whole register tiles)."""
    arrays = _case(3, (1, 2, 10), 7, 6, "float32", True, True)
    launch = _rb.launch_causal_dot_product_backward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rb, "launch_causal_dot_product_backward", functools.partial(launch, m_splits=m_splits))
        grads = _backward(arrays[0], *arrays[1:4], initial_state=arrays[4], dstate=arrays[5])
    _check(grads, *arrays, "float32")


def _strided(x):
    """The same values as a non-contiguous view: the last two axes stored transposed, then a negative row stride."""
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)[..., ::-1]).swapaxes(-1, -2)[..., ::-1, :]


def test_strided_inputs_and_states():
    arrays = _case(4, (1, 2, 9), 5, 6, "float16", True, True)
    views = [_strided(x) for x in arrays]
    assert not any(x.flags.c_contiguous for x in views)
    assert all(x.strides[-2] < 0 for x in views)
    grads = _backward(views[0], *views[1:4], initial_state=views[4], dstate=views[5])
    _check(grads, *arrays, "float16")


def test_two_dimensional_inputs():
    arrays = _case(5, (6,), 4, 7, "float32", True, True)
    grads = _backward(arrays[0], *arrays[1:4], initial_state=arrays[4], dstate=arrays[5])
    assert [g.shape for g in grads] == [(6, 4), (6, 4), (6, 7), (4, 7)]
    _check(grads, *arrays, "float32")


def test_every_element_is_written(poisoned_outputs):
    """Outputs start as NaN: an element the kernels leave unwritten shows as NaN."""
    for with_dstate in (False, True):
        arrays = _case(6, (1, 2, 8), 5, 3, "float16", True, with_dstate)
        grads = _backward(arrays[0], *arrays[1:4], initial_state=arrays[4], dstate=arrays[5])
        _check(grads, *arrays, "float16")


def test_empty_sequence():
    """No rows: empty dq, dk, dv; dinitial_state is dstate (zeros without it)."""
    for with_dstate in (False, True):
        arrays = _case(7, (1, 2, 0), 4, 3, "float32", True, with_dstate)
        grads = _backward(arrays[0], *arrays[1:4], initial_state=arrays[4], dstate=arrays[5])
        assert [g.shape for g in grads[:3]] == [(1, 2, 0, 4), (1, 2, 0, 4), (1, 2, 0, 3)]
        expected = arrays[5] if with_dstate else np.zeros((1, 2, 4, 3), np.float32)
        np.testing.assert_array_equal(grads[3], expected)


def test_numba_device_arrays_come_back_as_numba_arrays():
    from numba import cuda

    arrays = _case(8, (1, 2, 5), 4, 4, "float32", True, False)
    grads = _backward(*(cuda.to_device(x) for x in arrays[:4]), initial_state=cuda.to_device(arrays[4]))
    assert all(hasattr(g, "copy_to_host") for g in grads)
    _check(grads, *arrays, "float32")


# -- bad arguments ---------------------------------------------------------------------------------------------------
def _valid():
    return _case(9, (1, 2, 4), 4, 3, "float32", False, False)[:4]


@pytest.mark.parametrize("index,bad,error,match", [
    (0, np.zeros((1, 2, 4, 4), np.float32), ValueError, r"dout: expected the output's shape \(1, 2, 4, 3\)"),
    (0, np.zeros((1, 2, 5, 3), np.float32), ValueError, "dout: expected the output's shape"),
    (0, np.zeros((1, 2, 4, 3), np.float16), TypeError, "dout: dtype float16 differs"),
    (0, [[0.0]], TypeError, "dout: expected a NumPy array"),
    (1, np.zeros((1, 2, 4, 4), np.float64), TypeError, "q: dtype float64 is not supported"),
    (2, np.zeros((1, 2, 5, 4), np.float32), ValueError, "k:"),
    (3, np.zeros((1, 2, 4, 300), np.float32), ValueError, "v: value dim M"),
])
def test_bad_arrays_are_named(index, bad, error, match):
    arrays = list(_valid())
    arrays[index] = bad
    with pytest.raises(error, match=match):
        _backward(*arrays)


@pytest.mark.parametrize("name", ["initial_state", "dstate"])
@pytest.mark.parametrize("bad,error,match", [
    (np.zeros((1, 2, 3, 4), np.float32), ValueError, r"expected shape \(1, 2, 4, 3\)"),
    (np.zeros((4, 3), np.float32), ValueError, "expected shape"),
    (np.zeros((1, 2, 4, 3), np.float16), TypeError, "dtype float16 is not supported; expected float32"),
    (0.5, TypeError, "expected an array"),
])
def test_bad_states_are_named(name, bad, error, match):
    with pytest.raises(error, match=f"{name}: {match}"):
        _backward(*_valid(), **{name: bad})


def test_bfloat16_takes_no_recurrent_walk():
    torch = pytest.importorskip("torch")
    arrays = [torch.from_numpy(x).to(torch.bfloat16) for x in _valid()]
    with pytest.raises(ValueError, match="backend: 'recurrent' does not take bfloat16"):
        _backward(*arrays)


def test_signature_extends_the_references():
    """reference's parameters first, with its kinds and defaults; then the keyword-only extras of the forward."""
    import inspect

    ours = list(inspect.signature(numba_attn.causal_dot_product_backward).parameters.values())
    theirs = list(inspect.signature(reference.causal_dot_product_backward).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert [(p.name, p.kind, p.default) for p in ours[len(theirs):]] == \
        [("allow_tf32", inspect.Parameter.KEYWORD_ONLY, False), ("backend", inspect.Parameter.KEYWORD_ONLY, None)]


# -- realistic sizes, on a GPU only ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("with_states", [False, True])
def test_gpu_realistic_sizes(dtype, with_states):
    arrays = _case(10, (4, 8, 1024), 64, 64, dtype, with_states, with_states)
    grads = _backward(arrays[0], *arrays[1:4], initial_state=arrays[4], dstate=arrays[5])
    _check(grads, *arrays, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("e,m", [(128, 32), (256, 256)])
def test_gpu_wide_states_and_strides(e, m):
    arrays = _case(11, (2, 4, 300), e, m, "float16", True, True)
    views = [_strided(x) for x in arrays]
    grads = _backward(views[0], *views[1:4], initial_state=views[4], dstate=views[5])
    _check(grads, *arrays, "float16")


@pytest.mark.gpu
def test_gpu_cupy_arrays_in_place():
    cupy = pytest.importorskip("cupy")
    arrays = _case(12, (2, 4, 500), 64, 32, "float32", True, True)
    grads = _backward(*(cupy.asarray(x) for x in arrays[:4]), initial_state=cupy.asarray(arrays[4]),
                      dstate=cupy.asarray(arrays[5]))
    assert all(isinstance(g, cupy.ndarray) for g in grads)
    _check(grads, *arrays, "float32")

