"""NaN and inf: every path gives what `reference` gives (issue #26 item 6; the rules are in README.md, "Contract").

One call per kernel path: the scenarios sit in separate heads (a NaN key poisons its whole head). Paths that break
a rule today are strict xfails naming the kernel change they need; the fix turns them into failures (XPASS) so the
marker goes with it.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

import numba_attn
import reference


def assert_same_nonfinite(actual, expected, rtol, specified=None, what="out"):
    """NaN, +inf and -inf exactly where ``expected`` has them; finite values close. ``specified``: a boolean mask
    of the elements the contract defines (the others are not compared)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    mask = np.ones(expected.shape, bool) if specified is None else np.broadcast_to(specified, expected.shape)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        wrong = (kind(actual) != kind(expected)) & mask
        assert not wrong.any(), (
            f"{what}: {kind.__name__} differs at {np.argwhere(wrong).tolist()[:6]}: "
            f"got {actual[wrong][:6]}, expected {expected[wrong][:6]}")
    finite = np.isfinite(expected) & mask
    if finite.any():
        error = np.abs(actual[finite] - expected[finite]).max() / max(1.0, np.abs(expected[finite]).max())
        assert error <= rtol, f"{what}: error {error}"


# -- attention --------------------------------------------------------------------------------------------------------
def attention_scenarios(dtype):
    """(1, 3, 2, 8) queries against 5 keys:

    head 0: NaN in query row 0 (row 0: NaN out, NaN lse); row 1 scores all -inf (q = [inf, 0...], k[:, 0] < 0:
            0 and lse -inf, like a row that sees no key);
    head 1: NaN in a key (every row NaN, lse NaN);
    head 2: NaN in value column 3 and +inf in value column 2 (those columns NaN / +inf, lse finite).
    """
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 3, 5, 8)), rng.standard_normal((1, 3, 5, 8))
    q[0, 0, 0, 3] = np.nan
    q[0, 0, 1] = 0.0
    q[0, 0, 1, 0] = np.inf
    k[0, 0, :, 0] = -1.0 - np.abs(k[0, 0, :, 0])
    k[0, 1, 2, 1] = np.nan
    v[0, 2, 2, 3] = np.nan
    v[0, 2, 1, 2] = np.inf
    return tuple(x.astype(dtype) for x in (q, k, v))




def _xfail(kernel_change):
    return pytest.mark.xfail(strict=True, reason=f"needs kernel change: {kernel_change}")


TF32_SPLIT = ("3xTF32 with Tf32Config.split='cvt' (no longer the default; forward/tf32_split.py) splits x = hi + lo "
              "with hi = cvt.rna.tf32(x); for x = +-inf, lo = inf - inf is NaN. The other split modes keep +-inf "
              "(hi = +-1, lo = x); the default, 'warp', is one of them")


def _tf32_split(split):
    """The float32 tensor-core forward with ``Tf32Config.split = split`` (its default tiles for that mode)."""
    def call(q, k, v):
        from numba_attn.forward import tf32
        from numba_attn.runtime.device import cuda

        b, h, lq, d = q.shape
        out = cuda.to_device(np.zeros(q.shape, np.float32))
        lse = cuda.to_device(np.zeros((b, h, lq), np.float32))
        stream = 0 if numba_attn.SIMULATOR else cuda.default_stream()
        tf32.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, True, 1.0 / np.sqrt(d), False,
                    stream, config=tf32.default_config(d, False, split))
        return out.copy_to_host(), lse.copy_to_host()

    return call


#: the split modes that keep +-inf (forward/tf32_split.py)
TF32_INF_SPLITS = ("warp", "q", "kv", "qkv")


ATTENTION_PATHS = {
    # name: (call, dtype, out marks, lse marks)
    "forward-simt-fp32": (lambda q, k, v: numba_attn.flash_forward(q, k, v, return_lse=True, backend="simt"),
                          np.float32, [], []),
    "forward-mma-fp16": (lambda q, k, v: numba_attn.flash_forward(q, k, v, return_lse=True, backend="mma"),
                         np.float16, [], []),
    "forward-3xtf32-fp32": (lambda q, k, v: numba_attn.flash_forward(q, k, v, return_lse=True, backend="mma"),
                            np.float32, [], []),  # the default split, "warp", keeps +-inf
    "forward-3xtf32-fp32-split-cvt": (_tf32_split("cvt"), np.float32, [_xfail(TF32_SPLIT)], [_xfail(TF32_SPLIT)]),
    **{f"forward-3xtf32-fp32-split-{split}": (_tf32_split(split), np.float32, [], []) for split in TF32_INF_SPLITS},
    "forward-wgmma-fp16": (lambda q, k, v: numba_attn.flash_forward(q, k, v, return_lse=True, backend="wgmma"),
                           np.float16, [pytest.mark.gpu], [pytest.mark.gpu]),
    "decode-fp32": (lambda q, k, v: numba_attn.flash_decode(q, k, v, return_lse=True), np.float32, [], []),
    "decode-fp32-3-splits": (lambda q, k, v: numba_attn.flash_decode(q, k, v, return_lse=True, num_splits=3),
                             np.float32, [], []),
    "decode-fp16": (lambda q, k, v: numba_attn.flash_decode(q, k, v, return_lse=True), np.float16, [], []),
    "decode-fp16-3-splits": (lambda q, k, v: numba_attn.flash_decode(q, k, v, return_lse=True, num_splits=3),
                             np.float16, [], []),
}


@functools.lru_cache(maxsize=None)
def _attention_result(path):
    call, dtype, _, _ = ATTENTION_PATHS[path]
    q, k, v = attention_scenarios(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the simulator computes NaN and inf in NumPy
        out, lse = call(q, k, v)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    return out, lse, ref_out, ref_lse, 2e-3 if dtype == np.float16 else 1e-5


@pytest.mark.parametrize("path", [pytest.param(p, marks=m[2]) for p, m in ATTENTION_PATHS.items()])
def test_attention_out_nonfinite(path):
    out, _, ref_out, _, rtol = _attention_result(path)
    assert_same_nonfinite(out, ref_out, rtol)


@pytest.mark.parametrize("path", [pytest.param(p, marks=m[3]) for p, m in ATTENTION_PATHS.items()])
def test_attention_lse_nonfinite(path):
    _, lse, _, ref_lse, _ = _attention_result(path)
    assert_same_nonfinite(lse, ref_lse, 1e-4, what="lse")


def tf32_split_scenarios():
    """(1, 4, 3, 8) queries against 6 keys, the cases a 3xTF32 split meets (float32):

    head 0: k[:, 0] = -inf; q row 0 = [+inf, 0...] (inf * -inf: all scores -inf, 0 and lse -inf), row 1 = [-inf,
            0...] (+inf scores: NaN), row 2 finite with q[2, 0] = 0 (0 * -inf: NaN);
    head 1: v column 2 holds +inf and -inf (NaN), column 5 -inf (-inf);
    head 2: NaN bit patterns 0x7FFFFFFF (v column 1), 0x7F800001 (v column 6) and 0xFFFFFFFF (q row 1);
    head 3: v[0, 0] = 3.402e38, a finite value that rounds to inf in tf32 (column 0 finite, to about 1e-3).
    """
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 4, n, 8)).astype(np.float32) for n in (3, 6, 6))
    q[0, 0, :2] = 0.0
    q[0, 0, 0, 0], q[0, 0, 1, 0], q[0, 0, 2, 0] = np.inf, -np.inf, 0.0
    k[0, 0, :, 0] = -np.inf
    v[0, 1, 1, 2], v[0, 1, 3, 2], v[0, 1, 0, 5] = np.inf, -np.inf, -np.inf
    for x, at, bits in ((v, (0, 2, 2, 1), 0x7FFFFFFF), (v, (0, 2, 4, 6), 0x7F800001), (q, (0, 2, 1, 3), 0xFFFFFFFF)):
        x.view(np.uint32)[at] = bits
    v[0, 3, 0, 0] = 3.402e38
    return q, k, v


@pytest.mark.parametrize("split", TF32_INF_SPLITS)
def test_tf32_split_nonfinite(split):
    q, k, v = tf32_split_scenarios()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = _tf32_split(split)(q, k, v)
        ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert np.isneginf(ref_lse[0, 0, 0]) and np.isnan(ref_out[0, 0, 1:]).all() and np.isnan(ref_out[0, 1, :, 2]).all()
    huge = np.zeros(ref_out.shape, bool)
    huge[0, 3, :, 0] = True  # rounds like a tf32 product there: checked below
    assert_same_nonfinite(out, ref_out, 1e-5, specified=~huge)
    assert_same_nonfinite(lse, ref_lse, 1e-5, what="lse")
    np.testing.assert_allclose(out[0, 3, :, 0], ref_out[0, 3, :, 0], rtol=5e-3)


def test_reference_attention_rules():
    """The rules themselves, on the float64 reference."""
    q, k, v = attention_scenarios(np.float64)
    out, lse = reference.attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
    assert (out[0, 0, 1] == 0).all() and lse[0, 0, 1] == -np.inf
    assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 1]).all()
    assert np.isnan(out[0, 2, :, 3]).all() and np.isposinf(out[0, 2, :, 2]).all() and np.isfinite(lse[0, 2]).all()
    others = np.delete(out[0, 2], [2, 3], axis=-1)
    assert np.isfinite(others).all()
    # a +inf score: NaN row and lse
    q2 = q[:, 2:].copy()
    q2[0, 0, 0] = 0.0
    q2[0, 0, 0, 0] = np.inf
    k2 = np.abs(k[:, 2:]) + 1.0
    out, lse = reference.attention(q2, k2, np.ones_like(k2), return_lse=True)
    assert np.isnan(out[0, 0, 0]).all() and np.isnan(lse[0, 0, 0]) and np.isfinite(out[0, 0, 1]).all()


def test_reference_unseen_keys_never_reach_a_row():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    k[3, 0], v[3, 1] = np.nan, np.inf  # the last key: only the last query row sees it (causal)
    clean = reference.attention(q[:3], k[:3], v[:3], causal=True)
    for fn, kwargs in [(reference.attention, {}), (reference.flash_attention_v1, {"block_r": 2, "block_c": 2}),
                       (reference.flash_attention_v2, {"block_m": 2, "block_n": 2})]:
        out = fn(q, k, v, causal=True, **kwargs)
        np.testing.assert_allclose(out[:3], clean, rtol=1e-12)
        assert np.isnan(out[3]).all()
    for method in ("quadratic", "recurrent", "chunked"):
        out = reference.causal_dot_product(q, k, v, method=method, chunk_size=2)
        np.testing.assert_allclose(out[:3], reference.causal_dot_product(q[:3], k[:3], v[:3]), rtol=1e-12)


# -- combine_lse ------------------------------------------------------------------------------------------------------
def combine_scenarios(dtype):
    """Three parts of 4 rows: row 0 one part's lse NaN (NaN out and lse); row 1 every part empty (0, -inf);
    row 2 an empty part whose o is NaN (weight 0 * NaN: NaN out, finite lse); row 3 NaN in column 1 of a part's o
    (that column NaN)."""
    rng = np.random.default_rng(5)
    o, lse = rng.standard_normal((3, 4, 4)), rng.standard_normal((3, 4))
    lse[0, 0] = np.nan
    lse[:, 1] = -np.inf
    lse[1, 2], o[1, 2] = -np.inf, np.nan
    o[2, 3, 1] = np.nan
    return o.astype(dtype), lse.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_combine_lse_nonfinite(dtype):
    o, lse = combine_scenarios(dtype)
    out, merged = numba_attn.combine_lse(o, lse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref_out, ref_lse = reference.combine_lse(o, lse)
    assert_same_nonfinite(out, ref_out, 2e-3 if dtype == np.float16 else 1e-5)
    assert_same_nonfinite(merged, ref_lse, 1e-5, what="lse")


def test_combine_lse_plus_inf_part():
    o = np.random.default_rng(6).standard_normal((3, 1, 4)).astype(np.float32)
    lse = np.array([[0.5], [np.inf], [-1.0]], np.float32)
    out, merged = numba_attn.combine_lse(o, lse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref_out, ref_lse = reference.combine_lse(o, lse)
    assert np.isnan(ref_out).all() and np.isnan(ref_lse).all()
    assert_same_nonfinite(out, ref_out, 1e-5)
    assert_same_nonfinite(merged, ref_lse, 1e-5, what="lse")


# -- linear attention -------------------------------------------------------------------------------------------------
def linear_scenarios():
    """(3, 1, 5, 4): head 0 NaN in q row 1; head 1 NaN in k at position 2; head 2 NaN in v (position 3,
    column 1) and +inf in v (position 1, column 3)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 1, 5, 4)).astype(np.float32) for _ in range(3))
    q[0, 0, 1, 2] = np.nan
    k[1, 0, 2, 0] = np.nan
    v[2, 0, 3, 1] = np.nan
    v[2, 0, 1, 3] = np.inf
    return q, k, v


def _unseen(causal):
    """Elements that an unseen non-finite input may reach in a kernel (rows before it, causal): not compared."""
    unseen = np.zeros((3, 1, 5, 4), bool)
    if causal:
        unseen[1, 0, :2] = True  # before the NaN key at 2
        unseen[2, 0, :3] = True  # before the NaN value at 3 (and the inf at 1 for row 0)
    return unseen


LINEAR_CALLS = {
    "causal_dot_product": (numba_attn.causal_dot_product, reference.causal_dot_product, True),
    "linear_attention": (numba_attn.linear_attention, reference.linear_attention, False),
    "linear_attention-causal": (lambda *a, **kw: numba_attn.linear_attention(*a, causal=True, **kw),
                                lambda *a: reference.linear_attention(*a, causal=True), True),
}


def _check_linear(name, backend):
    fn, ref, causal = LINEAR_CALLS[name]
    q, k, v = linear_scenarios()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = np.asarray(fn(q, k, v, backend=backend), np.float64)
        expected = ref(q, k, v)
    specified = ~_unseen(causal)
    # NaN where reference has NaN; where an inf meets the sums the order decides between +-inf and NaN: any
    # non-finite value there, every other element close
    inf_reached = np.isinf(expected) & specified
    assert not np.isfinite(out[inf_reached]).any()
    assert_same_nonfinite(np.where(inf_reached, np.nan, out), np.where(inf_reached, np.nan, expected), 1e-5,
                          specified=specified)


@pytest.mark.parametrize("name", list(LINEAR_CALLS))
def test_linear_nonfinite_recurrent(name):
    _check_linear(name, "recurrent")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LINEAR_CALLS))
def test_linear_nonfinite_chunked(name):
    _check_linear(name, "chunked")
