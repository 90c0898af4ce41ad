"""The sequential linear-attention kernels (``backend="recurrent"`` of ``numba_attn.causal_dot_product`` and
``numba_attn.linear_attention``) against ``reference``; the chunked tensor-core kernel is in test_linear_chunked.py.

Three groups:

* tiny Hypothesis-drawn cases that run under the CUDA simulator (and on a GPU when there is one): every variant of
  the kernel forced in turn (the plain walk, the M split, the non-causal sequence split), odd lengths, E != M,
  float16 and float32, strided views;
* the launch planner (pure Python, GPU configuration): every E, M up to 256 gets a layout that fits;
* ``gpu`` tests at realistic sizes with CuPy arrays, outputs poisoned with NaN before the launch.

The variants are forced by wrapping the module's launchers with a keyword, so the public functions (and their
argument checks and array handling) stay on the path.
"""
from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error, to_host
from numba_attn.linear import recurrent as lr
from numba_attn.linear import recurrent_plan as rp

SIM = numba_attn.SIMULATOR


# -- helpers ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def forced(**keywords):
    """Make the public functions launch with these launcher keywords (m_splits, seq_splits); None entries dropped."""
    keywords = {name: value for name, value in keywords.items() if value is not None}
    if not keywords:
        yield
        return
    cdp_keywords = {name: value for name, value in keywords.items() if name == "m_splits"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            lr, "launch_causal_dot_product", functools.partial(lr.launch_causal_dot_product, **cdp_keywords)
        )
        mp.setattr(lr, "launch_linear_attention", functools.partial(lr.launch_linear_attention, **keywords))
        yield


def make_array(rng, shape, dtype, strided=False, scale=1.0):
    """Normal values rounded to ``dtype``; ``strided``: a view with swapped (heads, seqlen) axes and a column step."""
    values = (rng.standard_normal(shape) * scale).astype(dtype)
    if not strided:
        return values
    if len(shape) == 4:
        b, h, n, d = shape
        base = np.zeros((b, n, h, 2 * d), dtype=dtype)
        view = base.transpose(0, 2, 1, 3)[..., ::2]
    else:
        n, d = shape
        base = np.zeros((n, 3 * d), dtype=dtype)
        view = base[:, 1::3]
    view[...] = values
    assert view.size <= 1 or view.strides != values.strides
    return view


def m_splits_for(variant: str, e: int, m: int):
    """Launcher keyword for a variant: None (heuristic), the fewest blocks per (batch, head), or as many as M allows."""
    if variant == "auto":
        return None
    if variant == "plain":
        return rp.min_m_splits(e, m)
    return m


def layer_reference(q, k, v, causal, eps):
    return reference.linear_attention(q, k, v, causal=causal, eps=eps)


# -- simulator-sized cases (Hypothesis) ------------------------------------------------------------------------------
dims = st.integers(1, 9)
seqlens = st.integers(1, 20)
dtypes = st.sampled_from(["float32", "float16"])
variants = st.sampled_from(["auto", "plain", "split"])


@st.composite
def linear_case(draw):
    rank2 = draw(st.booleans())
    batch, heads = (1, 1) if rank2 else (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    case = {
        "batch": batch,
        "heads": heads,
        "rank2": rank2,
        "seqlen": draw(seqlens),
        "e": draw(dims),
        "m": draw(dims),
        "dtype": draw(dtypes),
        "strided": draw(st.sampled_from([None, "q", "k", "v"])),
        "variant": draw(variants),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }
    return case


def case_inputs(case):
    rng = np.random.default_rng(case["seed"])
    lead = () if case["rank2"] else (case["batch"], case["heads"])
    n, e, m = case["seqlen"], case["e"], case["m"]
    arrays = {}
    for name, last in (("q", e), ("k", e), ("v", m)):
        arrays[name] = make_array(rng, lead + (n, last), case["dtype"], strided=case["strided"] == name)
    return arrays["q"], arrays["k"], arrays["v"]


@given(case=linear_case())
def test_causal_dot_product_matches_reference(case):
    q, k, v = case_inputs(case)
    with forced(m_splits=m_splits_for(case["variant"], case["e"], case["m"])):
        out = numba_attn.causal_dot_product(q, k, v, backend="recurrent")
    assert out.dtype == np.dtype(case["dtype"]) and out.shape == v.shape
    ref = reference.causal_dot_product(q, k, v)  # from the same (rounded) inputs, in float64
    assert rel_error(out, ref) <= TOLERANCE[case["dtype"]]


@given(
    case=linear_case(),
    causal=st.booleans(),
    eps=st.sampled_from([0.0, 1e-6, 0.1, 3.0]),
    seq_splits=st.sampled_from([None, 1, 3]),
)
def test_linear_attention_matches_reference(case, causal, eps, seq_splits):
    q, k, v = case_inputs(case)
    m_splits = m_splits_for(case["variant"], case["e"], case["m"])
    with forced(m_splits=m_splits, seq_splits=None if causal else seq_splits):
        out = numba_attn.linear_attention(q, k, v, causal=causal, eps=eps, backend="recurrent")
    assert out.dtype == np.dtype(case["dtype"]) and out.shape == v.shape
    ref = layer_reference(q, k, v, causal, eps)
    assert rel_error(out, ref) <= TOLERANCE[case["dtype"]]


@settings(max_examples=20)
@given(
    op=st.sampled_from(["causal_dot_product", "causal", "non-causal"]),
    seqlen=seqlens,
    e=dims,
    # on a GPU, M is rounded up to whole tiles of 8 columns: only M > 8 can split there
    m=st.integers(2, 9) if SIM else st.integers(9, 40),
    splits=st.integers(2, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_m_split_matches_one_block(op, seqlen, e, m, splits, seed):
    """Each block of the M split owns whole columns of the state: only float32 rounding may differ."""
    rng = np.random.default_rng(seed)
    q, k = (make_array(rng, (1, 2, seqlen, e), "float32") for _ in range(2))
    v = make_array(rng, (1, 2, seqlen, m), "float32")
    plain = rp.min_m_splits(e, m)
    splits = max(splits, plain + 1)
    actual = rp.plan(e, m, rp.CAUSAL, op != "causal_dot_product", splits).m_splits
    assert actual > plain, "the forced split must give more blocks than the plain walk"

    def run(m_splits):
        with forced(m_splits=m_splits):
            if op == "causal_dot_product":
                return numba_attn.causal_dot_product(q, k, v, backend="recurrent")
            return numba_attn.linear_attention(q, k, v, causal=op == "causal", backend="recurrent")

    one, split = run(plain), run(splits)
    assert rel_error(split, one) <= 1e-6


def test_fp16_output_rounding_and_rank2():
    """(seqlen, E) inputs come back (seqlen, M) in float16; one row, one feature."""
    q = np.array([[0.5]], dtype=np.float16)
    k = np.array([[2.0]], dtype=np.float16)
    v = np.array([[3.0, -1.0]], dtype=np.float16)
    out = numba_attn.causal_dot_product(q, k, v)
    assert out.dtype == np.float16 and out.shape == (1, 2)
    np.testing.assert_array_equal(out, np.array([[3.0, -1.0]], dtype=np.float16))
    layer = numba_attn.linear_attention(q, k, v, causal=True, eps=0.0)
    np.testing.assert_allclose(layer, v.astype(np.float64), rtol=1e-3)  # one key: the weights normalise to 1


def test_empty_sequence_and_batch():
    q = np.zeros((2, 3, 0, 4), dtype=np.float32)
    v = np.zeros((2, 3, 0, 5), dtype=np.float32)
    assert numba_attn.causal_dot_product(q, q, v).shape == (2, 3, 0, 5)
    assert numba_attn.linear_attention(q, q, v, causal=False).shape == (2, 3, 0, 5)
    q = np.zeros((0, 3, 4, 4), dtype=np.float32)
    v = np.zeros((0, 3, 4, 5), dtype=np.float32)
    assert numba_attn.linear_attention(q, q, v).shape == (0, 3, 4, 5)


# -- bad input through the public API --------------------------------------------------------------------------------
def _zeros(*shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


BAD_SHAPES = [
    pytest.param((1, 1, 5, 3), (1, 1, 5, 3), (1, 1, 6, 4), "v", id="seqlen-q-v"),
    pytest.param((1, 1, 5, 3), (1, 1, 4, 3), (1, 1, 5, 4), "k", id="seqlen-q-k"),
    pytest.param((1, 1, 5, 3), (1, 1, 5, 4), (1, 1, 5, 4), "k", id="E-q-k"),
    pytest.param((1, 1, 5, 0), (1, 1, 5, 0), (1, 1, 5, 4), "q", id="E-0"),
    pytest.param((1, 1, 5, 257), (1, 1, 5, 257), (1, 1, 5, 4), "q", id="E-257"),
    pytest.param((1, 1, 5, 3), (1, 1, 5, 3), (1, 1, 5, 0), "v", id="M-0"),
    pytest.param((1, 1, 5, 3), (1, 1, 5, 3), (1, 1, 5, 257), "v", id="M-257"),
    pytest.param((2, 1, 5, 3), (1, 1, 5, 3), (2, 1, 5, 4), "k", id="batch-q-k"),
    pytest.param((5, 3), (5, 3), (1, 1, 5, 4), "q, k, v", id="rank"),
]


@pytest.mark.parametrize("q_shape, k_shape, v_shape, name", BAD_SHAPES)
@pytest.mark.parametrize("op", ["causal_dot_product", "linear_attention"])
def test_bad_shapes_raise_naming_the_argument(op, q_shape, k_shape, v_shape, name):
    fn = getattr(numba_attn, op)
    with pytest.raises(ValueError, match="^" + name + ":"):
        fn(_zeros(*q_shape), _zeros(*k_shape), _zeros(*v_shape))


@pytest.mark.parametrize("eps", [-1e-6, -1.0, math.nan, math.inf, True, "1e-6", None])
def test_bad_eps_raises(eps):
    q = _zeros(1, 1, 3, 2)
    with pytest.raises(ValueError, match="^eps:"):
        numba_attn.linear_attention(q, q, _zeros(1, 1, 3, 2), eps=eps)


def test_bad_dtype_raises_type_error():
    q = _zeros(1, 1, 3, 2, dtype="float64")
    with pytest.raises(TypeError, match="^q:"):
        numba_attn.causal_dot_product(q, q, q)
    with pytest.raises(TypeError, match="^v:"):
        numba_attn.linear_attention(_zeros(1, 1, 3, 2), _zeros(1, 1, 3, 2), _zeros(1, 1, 3, 2, dtype="float16"))


@pytest.mark.parametrize("m_splits", [0, -1, 1.5, True, "2"])
def test_bad_m_splits_raises(m_splits):
    with pytest.raises(ValueError, match="^m_splits:"):
        rp.plan(8, 8, rp.CAUSAL, False, m_splits)


def test_m_splits_below_register_minimum_raises():
    with pytest.raises(ValueError, match="^m_splits:.*at least 4"):
        rp.plan(256, 256, rp.CAUSAL, False, 1, rp.GPU_CONFIG)


# -- the launch planner (GPU configuration, pure Python) --------------------------------------------------------------
PLANNER_DIMS = [1, 2, 7, 8, 9, 16, 31, 32, 33, 64, 100, 128, 129, 200, 255, 256]


@pytest.mark.parametrize("e", PLANNER_DIMS)
def test_every_shape_gets_a_layout_that_fits(e):
    config = rp.GPU_CONFIG
    for m in PLANNER_DIMS:
        lowest = rp.min_m_splits(e, m, config)
        for splits in sorted({lowest, lowest + 1, 2 * lowest, max(lowest, m // 8), m}):
            for mode, normalise in ((rp.CAUSAL, False), (rp.CAUSAL, True), (rp.REDUCE, True), (rp.APPLY, True)):
                p = rp.plan(e, m, mode, normalise, splits, config)
                layout = p.layout
                assert layout.threads <= config.max_threads
                assert layout.re * layout.rm <= config.state_per_thread
                assert layout.e_pad >= e
                assert layout.m_cols * p.m_splits >= m > layout.m_cols * (p.m_splits - 1)
                assert p.m_splits <= splits
                assert layout.shared_bytes(mode, normalise) <= config.max_shared_bytes
                assert layout.rows >= 1
                assert layout.rows == 1 or layout.prefetch(mode) <= config.max_prefetch


def test_split_heuristic():
    config = rp.GPU_CONFIG
    # few (batch, head) blocks on many SMs: split M; many blocks: the plain walk
    assert rp.choose_m_splits(8, 64, 64, 132, config) > 1
    assert rp.choose_m_splits(4096, 64, 64, 132, config) == 1
    # E = M = 256 cannot keep its state in one block's registers
    assert rp.min_m_splits(256, 256, config) > 1
    assert rp.choose_m_splits(4096, 256, 256, 132, config) == rp.min_m_splits(256, 256, config)
    # never below 8 columns per block
    assert rp.choose_m_splits(1, 64, 64, 132, config) == 8


def test_short_non_causal_sequences_split_over_blocks():
    """B1 H2 N256 (``scripts/startup.py``'s case) on 132 SMs: 8 blocks of 32 rows per (batch, head) and pass, not one
    block walking all 256 rows; many (batch, head) pairs keep one block each."""
    config = rp.GPU_CONFIG
    assert rp.sequence_blocks(256, 2, 132, config) == (8, 32)
    assert rp.sequence_blocks(256, 4096, 132, config) == (1, 256)
    assert rp.sequence_blocks(5, 2, 132, config) == (1, 5)


def test_simulator_config_allows_the_plain_walk_for_the_drawn_sizes():
    for e in range(1, 10):
        for m in range(1, 10):
            assert rp.min_m_splits(e, m, rp.SIMULATOR_CONFIG) == 1


# -- realistic sizes on a GPU -----------------------------------------------------------------------------------------
GPU_B, GPU_H, GPU_N = 2, 4, 4097
GPU_DIMS = [(64, 64), (32, 128), (256, 256)]


@functools.lru_cache(maxsize=None)
def gpu_inputs(e, m):
    """float16-representable inputs of realistic scale (shared by the float16 and float32 runs) and references."""
    rng = np.random.default_rng(1000 * e + m)
    q = (rng.standard_normal((GPU_B, GPU_H, GPU_N, e)) / math.sqrt(e)).astype(np.float16)
    k = (rng.standard_normal((GPU_B, GPU_H, GPU_N, e)) / math.sqrt(e)).astype(np.float16)
    v = rng.standard_normal((GPU_B, GPU_H, GPU_N, m)).astype(np.float16)
    return q, k, v


@functools.lru_cache(maxsize=None)
def gpu_reference(e, m, op):
    q, k, v = gpu_inputs(e, m)
    if op == "causal_dot_product":
        return reference.causal_dot_product(q, k, v, method="chunked", chunk_size=256)
    causal = op == "causal"
    out = np.empty(v.shape, dtype=np.float64)
    for b in range(GPU_B):  # one (batch, head) at a time: the causal reference is quadratic in memory
        for h in range(GPU_H):
            out[b, h] = reference.linear_attention(q[b, h], k[b, h], v[b, h], causal=causal, eps=1e-6)
    return out


def _device_views(dtype, arrays, strided_name=None):
    import cupy as cp

    views = []
    for name, x in zip("qkv", arrays):
        x = x.astype(dtype)
        if name == strided_name:
            b, h, n, d = x.shape
            base = cp.zeros((b, n, h, 2 * d), dtype=dtype)
            dev = base.transpose(0, 2, 1, 3)[..., ::2]
            dev[...] = cp.asarray(x)
        else:
            dev = cp.asarray(x)
        views.append(dev)
    return views


def _launch_poisoned(op, q, k, v, m_splits, seq_splits=None):
    """Call the launcher directly on a NaN-filled output (the public functions allocate theirs)."""
    import cupy as cp
    from numba import cuda

    out = cp.full(v.shape, cp.nan, dtype=v.dtype)
    ptr = cp.cuda.get_current_stream().ptr
    stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
    views = [cuda.as_cuda_array(x, sync=False) for x in (q, k, v, out)]
    if op == "causal_dot_product":
        lr.launch_causal_dot_product(*views, stream, m_splits=m_splits)
    else:
        lr.launch_linear_attention(*views, op == "causal", 1e-6, stream, m_splits=m_splits, seq_splits=seq_splits)
    cp.cuda.get_current_stream().synchronize()
    return out


def _gpu_m_splits(variant, e, m):
    lowest = rp.min_m_splits(e, m, rp.GPU_CONFIG)
    return {"auto": None, "plain": lowest, "split": max(2 * lowest, 8)}[variant]


@pytest.mark.gpu
@pytest.mark.parametrize("e, m", GPU_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("variant", ["auto", "plain", "split"])
@pytest.mark.parametrize("op", ["causal_dot_product", "causal", "non-causal"])
def test_gpu_realistic_sizes(op, variant, dtype, e, m):
    q, k, v = _device_views(dtype, gpu_inputs(e, m), strided_name="k" if variant == "split" else None)
    out = _launch_poisoned(op, q, k, v, _gpu_m_splits(variant, e, m))
    out = to_host(out)
    assert not np.isnan(out).any(), "some output elements were never written"
    assert rel_error(out, gpu_reference(e, m, op)) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["recurrent", None])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("op", ["causal_dot_product", "causal", "non-causal"])
def test_gpu_public_api_cupy(op, dtype, backend):
    """The public functions on CuPy arrays (one of them strided): CuPy out, caller's stream, correct values."""
    import cupy as cp

    e, m = 32, 128
    q, k, v = _device_views(dtype, gpu_inputs(e, m), strided_name="q")
    if op == "causal_dot_product":
        out = numba_attn.causal_dot_product(q, k, v, backend=backend)
    else:
        out = numba_attn.linear_attention(q, k, v, causal=op == "causal", eps=1e-6, backend=backend)
    assert isinstance(out, cp.ndarray) and out.dtype == np.dtype(dtype)
    assert rel_error(out, gpu_reference(e, m, op)) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("e, m", GPU_DIMS)
@pytest.mark.parametrize("op", ["causal_dot_product", "causal"])
def test_gpu_m_split_matches_one_block(op, e, m):
    q, k, v = _device_views("float32", gpu_inputs(e, m))
    lowest = rp.min_m_splits(e, m, rp.GPU_CONFIG)
    one = to_host(_launch_poisoned(op, q, k, v, lowest))
    split = to_host(_launch_poisoned(op, q, k, v, max(8, 2 * lowest)))
    assert rel_error(split, one) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("seq_splits", [1, 5, 64])
def test_gpu_non_causal_sequence_splits(seq_splits):
    e, m = 64, 64
    q, k, v = _device_views("float32", gpu_inputs(e, m))
    out = to_host(_launch_poisoned("non-causal", q, k, v, None, seq_splits=seq_splits))
    assert rel_error(out, gpu_reference(e, m, "non-causal")) <= TOLERANCE["float32"]
