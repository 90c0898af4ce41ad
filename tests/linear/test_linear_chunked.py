"""The chunked tensor-core linear-attention kernel (``backend="chunked"``) against ``reference``.

* Simulator cases (Hypothesis, tiny: one warp, 16-row chunks, 8-column M tiles): the causal dot product with every
  split of the sequence into segments (so the STATES pass and the prefix kernel run), initial and final states,
  several M tiles, odd lengths, E != M, strided views, float16 and float32 (three tf32 terms and one); the causal
  and non-causal layer.
* Properties of the state API: processing a sequence in two pieces, carrying the state, equals one call.
* ``gpu`` tests at realistic sizes (E, M up to 256, bfloat16 through torch), outputs poisoned with NaN.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error, to_host
from numba_attn.linear import launch as lc
from numba_attn.linear import shared_state as ss
from numba_attn.runtime.device import max_shared_per_block

SIM = numba_attn.SIMULATOR
#: one tf32 term per product (allow_tf32=True): float32 inputs rounded to 10 mantissa bits
TF32_TOLERANCE = 5e-3
#: the same with the operands rounded to tf32 (mma_f32.ROUND_SCALE), as the register-state kernel does: about
#: 4.5e-4 on these inputs
ROUNDED_TF32_TOLERANCE = 1e-3


def make_array(rng, shape, dtype, strided=False):
    values = rng.standard_normal(shape).astype(dtype)
    if not strided:
        return values
    b, h, n, d = shape
    base = np.zeros((b, n, h, 2 * d), dtype=dtype)
    view = base.transpose(0, 2, 1, 3)[..., ::2]
    view[...] = values
    return view


@contextlib.contextmanager
def forced_segments(segments, kernel=None):
    """Make the public functions launch the chunked kernel with this many sequence segments (None: heuristic) and,
    for the causal product, this ``kernel`` (``lc.KERNELS``; None: the dispatch's choice)."""
    with pytest.MonkeyPatch.context() as mp:
        if segments is not None:
            for name in ("launch_causal", "launch_noncausal"):
                mp.setattr(lc, name, functools.partial(getattr(lc, name), segments=segments))
        if kernel is not None:
            mp.setattr(lc, "launch_causal", functools.partial(lc.launch_causal, kernel=kernel))
        yield


@st.composite
def chunk_case(draw):
    return {
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 2)),
        "seqlen": draw(st.integers(1, 40)),
        "e": draw(st.integers(1, 20)),
        "m": draw(st.integers(1, 17)),
        "dtype": draw(st.sampled_from(["float32", "float16"])),
        "tf32": draw(st.booleans()),
        "segments": draw(st.sampled_from([None, 1, 2, 3])),
        "kernel": draw(st.sampled_from([None, "shared"])),  # None: the register-state kernels where they apply
        "strided": draw(st.sampled_from([None, "q", "k", "v"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def case_inputs(case):
    rng = np.random.default_rng(case["seed"])
    lead = (case["batch"], case["heads"])
    n = case["seqlen"]
    q = make_array(rng, lead + (n, case["e"]), case["dtype"], case["strided"] == "q")
    k = make_array(rng, lead + (n, case["e"]), case["dtype"], case["strided"] == "k")
    v = make_array(rng, lead + (n, case["m"]), case["dtype"], case["strided"] == "v")
    return q, k, v


def tolerance(case):
    if case["dtype"] == "float32" and case["tf32"]:
        return TF32_TOLERANCE
    return TOLERANCE[case["dtype"]]


@settings(max_examples=8)  # (each example runs several simulated kernels: ~7 s on CI's 2 cores)
@given(case=chunk_case(), with_state=st.booleans())
def test_causal_dot_product_matches_reference(case, with_state):
    q, k, v = case_inputs(case)
    rng = np.random.default_rng(case["seed"] + 1)
    s0 = rng.standard_normal((case["batch"], case["heads"], case["e"], case["m"])).astype(np.float32)
    kwargs = {"initial_state": s0, "return_state": True} if with_state else {}
    with forced_segments(case["segments"], case["kernel"]):
        result = numba_attn.causal_dot_product(q, k, v, backend="chunked", allow_tf32=case["tf32"], **kwargs)
    ref = reference.causal_dot_product(q, k, v, initial_state=s0 if with_state else None, return_state=True)
    out, state = result if with_state else (result, None)
    assert out.dtype == np.dtype(case["dtype"]) and out.shape == v.shape
    assert rel_error(out, ref[0]) <= tolerance(case)
    if with_state:
        assert state.dtype == np.float32 and state.shape == s0.shape
        # the state is float32 whatever the inputs; its error is that of float32 (or tf32) sums
        assert rel_error(state, ref[1]) <= (TF32_TOLERANCE if case["tf32"] and case["dtype"] == "float32" else 1e-5)


@settings(max_examples=7)
@given(case=chunk_case(), causal=st.booleans(), eps=st.sampled_from([0.0, 1e-6, 0.5]))
def test_linear_attention_matches_reference(case, causal, eps):
    q, k, v = case_inputs(case)
    with forced_segments(case["segments"]):
        out = numba_attn.linear_attention(q, k, v, causal=causal, eps=eps, backend="chunked",
                                          allow_tf32=case["tf32"])
    assert out.dtype == np.dtype(case["dtype"]) and out.shape == v.shape
    assert rel_error(out, reference.linear_attention(q, k, v, causal=causal, eps=eps)) <= tolerance(case)


@settings(max_examples=4)
@given(n=st.integers(2, 40), cut=st.integers(0, 40), e=st.integers(1, 12), m=st.integers(1, 12),
       seed=st.integers(0, 2**32 - 1))
def test_two_pieces_with_carried_state_equal_one_call(n, cut, e, m, seed):
    """The state API's promise: ``out`` and the final state of a sequence do not depend on where it is cut."""
    cut = min(cut, n)
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((1, 2, n, e)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, n, m)).astype(np.float32)
    whole, whole_state = numba_attn.causal_dot_product(q, k, v, return_state=True, backend="chunked")
    first, state = numba_attn.causal_dot_product(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], return_state=True,
                                                 backend="chunked")
    second, final = numba_attn.causal_dot_product(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], initial_state=state,
                                                  return_state=True, backend="chunked")
    assert rel_error(np.concatenate([first, second], axis=2), whole) <= 1e-5
    assert rel_error(final, whole_state) <= 1e-5


def test_empty_sequence_returns_the_initial_state():
    q = np.zeros((1, 2, 0, 3), np.float32)
    v = np.zeros((1, 2, 0, 5), np.float32)
    s0 = np.arange(30, dtype=np.float32).reshape(1, 2, 3, 5)
    out, state = numba_attn.causal_dot_product(q, q, v, initial_state=s0, return_state=True)
    assert out.shape == (1, 2, 0, 5)
    np.testing.assert_array_equal(state, s0)
    out, state = numba_attn.causal_dot_product(q, q, v, return_state=True)
    np.testing.assert_array_equal(state, np.zeros_like(s0))


def test_rank2_state_and_fp16_rounding():
    q = np.array([[0.5], [1.0]], dtype=np.float16)
    k = np.array([[2.0], [1.0]], dtype=np.float16)
    v = np.array([[3.0, -1.0], [1.0, 2.0]], dtype=np.float16)
    out, state = numba_attn.causal_dot_product(q, k, v, initial_state=np.ones((1, 2), np.float32),
                                               return_state=True)
    # row 0: 0.5 * (1 + 2 * [3, -1]) ; row 1: 1 * (1 + 2 * [3, -1] + 1 * [1, 2])
    np.testing.assert_array_equal(out, np.array([[3.5, -0.5], [8.0, 1.0]], dtype=np.float16))
    np.testing.assert_array_equal(state, np.array([[8.0, 1.0]], dtype=np.float32))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"initial_state": np.zeros((1, 2, 4, 5), np.float32)}, ValueError, "initial_state: expected shape"),
        ({"initial_state": np.zeros((1, 2, 4, 6), np.float16)}, TypeError, "initial_state: dtype float16"),
        ({"initial_state": [[0.0]]}, TypeError, "initial_state: expected an array"),
        ({"return_state": "yes"}, TypeError, "return_state"),
        ({"allow_tf32": 1}, TypeError, "allow_tf32"),
        ({"backend": "fast"}, ValueError, "backend: expected one of chunked, recurrent"),
        ({"backend": "recurrent", "return_state": True}, ValueError, "backend: 'recurrent' takes no initial_state"),
    ],
)
def test_bad_state_arguments_raise(kwargs, error, match):
    q = np.zeros((1, 2, 3, 4), np.float32)
    v = np.zeros((1, 2, 3, 6), np.float32)
    with pytest.raises(error, match=match):
        numba_attn.causal_dot_product(q, q, v, **kwargs)


def _launch_f16_products(q, k, v, dtype, segments=None):
    """``lc.launch_causal`` on the f16 MMAs (``mma``) with uint16 bit views (the way bfloat16 travels), on the
    host or a GPU."""
    bits = [np.ascontiguousarray(x.view(np.uint16)) for x in (q, k, v)]
    out = np.full(v.shape, 0x7E00, np.uint16)  # NaN in float16 and bfloat16: unwritten elements show
    final = np.full(q.shape[:2] + (q.shape[3], v.shape[3]), np.nan, np.float32)
    if SIM:
        lc.launch_causal(*bits, out, None, final_state=final, dtype=dtype, segments=segments, kernel="registers")
        return out, final
    from numba import cuda

    views = [cuda.to_device(x) for x in bits + [out, final]]
    lc.launch_causal(*views[:4], cuda.default_stream(), final_state=views[4], dtype=dtype, segments=segments,
                     kernel="registers")
    return views[3].copy_to_host(), views[4].copy_to_host()


def _as_float(bits, dtype):
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float64)
    from numba_attn.core import ptx

    return ptx.bf16_bits_to_float32(bits).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_f16_products_survive_scores_beyond_float16_range(dtype):
    """P is rounded to the input dtype before ``P V``; float16 scores past 65504 are scaled by a power of two first
    (without that, this case gives inf). bfloat16 runs through uint16 bit views as it does from torch."""
    rng = np.random.default_rng(7)
    n, e, m = (37, 16, 16) if SIM else (3001, 64, 64)
    scale = 100.0 if SIM else 60.0
    q = rng.standard_normal((1, 2, n, e)) * scale
    k = rng.standard_normal((1, 2, n, e)) * scale
    v = rng.standard_normal((1, 2, n, m)) * 1e-3
    if dtype == "float16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    else:
        from numba_attn.core import ptx

        q, k, v = (ptx.float32_to_bf16_bits(x.astype(np.float32)).view(np.float16) for x in (q, k, v))
    fq, fk, fv = (_as_float(x.view(np.uint16), dtype) for x in (q, k, v))
    assert np.abs(np.einsum("bhie,bhje->bhij", fq, fk)).max() > 2 * 65504  # the case this test is about
    out, final = _launch_f16_products(q, k, v, dtype, segments=2)
    ref, ref_state = reference.causal_dot_product(fq, fk, fv, return_state=True)
    got = _as_float(out, dtype)
    assert np.isfinite(got).all()
    assert rel_error(got, ref) <= TOLERANCE[dtype]
    assert rel_error(final, ref_state) <= 1e-5


def _tensor_core_truncation(x):
    """The tf32 operand the tensor cores read: float32 with its low 13 bits dropped."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False,
                 min_value=-float(np.float32(3e38)), max_value=float(np.float32(3e38))))
def test_tf32_rounding_by_multiply_stays_within_one_ulp(x):
    """``allow_tf32`` rounds an operand as ``x * ROUND_SCALE`` and lets the tensor cores truncate: the result is one
    of the two tf32 neighbours of x (never further), with the same sign. (Normal floats below 3e38: above that the
    multiply may reach inf a little early, where round to nearest would give the largest tf32.)"""
    from numba_attn.linear.mma_f32 import ROUND_SCALE

    x = np.float32(x)
    got = _tensor_core_truncation(x * ROUND_SCALE)
    down = _tensor_core_truncation(x)
    ulp = np.float32(2.0) ** (np.floor(np.log2(np.abs(x))) - 10) if x != 0 else np.float32(0)
    assert got == down or abs(float(got) - float(down)) == float(ulp)
    assert np.signbit(got) == np.signbit(x)


def test_tf32_rounding_by_multiply_is_unbiased_and_keeps_nan_and_inf():
    from numba_attn.linear.mma_f32 import ROUND_SCALE

    x = np.random.default_rng(3).standard_normal(1_000_000).astype(np.float32)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(x))) - 10)
    error = (_tensor_core_truncation(x * ROUND_SCALE).astype(np.float64) - x) / ulp * np.sign(x)  # in ulps, outward
    assert abs(error.mean()) < 0.02  # truncation alone: -0.5
    assert np.sqrt((error ** 2).mean()) < 0.32  # round to nearest: 1 / sqrt(12) = 0.29
    specials = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)
    got = _tensor_core_truncation(specials * ROUND_SCALE)
    assert np.isnan(got[:3]).all() and (got[3:] == specials[3:]).all()


def test_kernel_argument_is_checked():
    q = np.zeros((1, 1, 4, 8), np.float32)
    wide = np.zeros((1, 1, 4, 136), np.float32)
    with pytest.raises(ValueError, match="kernel: 'registers' takes"):
        lc.launch_causal(wide, wide, q, q.copy(), None, kernel="registers")
    with pytest.raises(ValueError, match="kernel: 'registers' takes"):
        lc.launch_causal(q, q, q, q.copy(), None, normalise=True, kernel="registers")
    with pytest.raises(ValueError, match="kernel: expected one of"):
        lc.launch_causal(q, q, q, q.copy(), None, kernel="f16")


def test_plan_fills_the_gpu_and_every_shape_fits():
    config = ss.GPU_CONFIG
    for e in (1, 16, 64, 100, 128, 129, 256):
        for m in (1, 64, 72, 256):
            for normalise in (False, True):
                tiles = ss.tiles_for(config, e, m, normalise)
                assert tiles.shared_bytes <= max_shared_per_block()
    p = ss.plan(32, 16384, 64, 64, False, 132, config)
    assert p.segments * 32 * p.m_tiles >= config.blocks_per_sm * 132
    assert p.segments * p.segment_chunks * p.tiles.chunk >= 16384
    assert (p.segments - 1) * p.segment_chunks * p.tiles.chunk < 16384  # no empty segment
    assert ss.plan(4096, 16384, 64, 64, False, 132, config).segments == 1  # enough heads: no extra passes
    assert ss.plan(1, 100, 64, 64, False, 132, config, segments=50).segments == 2  # never more than the chunks


def _walk_cost(bh, chunks, segments, slots, config):
    """Critical path of the chunked walk in chunk steps: waves of blocks times chunks per segment, plus the STATES
    pass and a cost per segment when there is more than one segment."""
    segment_chunks = -(-chunks // segments)
    segments = -(-chunks // segment_chunks)
    steps = -(-bh * segments // slots) * segment_chunks
    return steps * (1 + config.states_cost) + config.segment_cost * segments if segments > 1 else steps


@given(bh=st.integers(1, 3000), seqlen=st.integers(1, 300_000), resident=st.integers(1, 4),
       sm_count=st.integers(1, 140), segment_cost=st.sampled_from([0.0, 0.1, 2.5]))
def test_plan_with_occupancy_takes_the_shortest_critical_path(bh, seqlen, resident, sm_count, segment_cost):
    """Against every segment count: none gives the walk a shorter critical path than the plan's choice."""
    config = dataclasses.replace(ss.GPU_CONFIG, segment_cost=segment_cost)
    p = ss.plan(bh, seqlen, 64, 64, False, sm_count, config, resident=resident)
    chunks = -(-seqlen // p.tiles.chunk)
    slots = resident * sm_count
    best = min(_walk_cost(bh, chunks, s, slots, config)
               for s in range(1, max(1, chunks // config.min_segment_chunks) + 1))
    assert _walk_cost(bh, chunks, p.segments, slots, config) == pytest.approx(best)
    assert (p.segments - 1) * p.segment_chunks < chunks <= p.segments * p.segment_chunks


# -- realistic sizes on a GPU -----------------------------------------------------------------------------------------
GPU_B, GPU_H, GPU_N = 2, 3, 3001
GPU_DIMS = [(64, 64), (32, 128), (100, 44), (256, 256)]  # 44: M tiles of 32 columns, the last 12 wide


@functools.lru_cache(maxsize=None)
def gpu_inputs(e, m):
    rng = np.random.default_rng(1000 * e + m)
    q = (rng.standard_normal((GPU_B, GPU_H, GPU_N, e)) / math.sqrt(e)).astype(np.float32)
    k = (rng.standard_normal((GPU_B, GPU_H, GPU_N, e)) / math.sqrt(e)).astype(np.float32)
    v = rng.standard_normal((GPU_B, GPU_H, GPU_N, m)).astype(np.float32)
    s0 = rng.standard_normal((GPU_B, GPU_H, e, m)).astype(np.float32)
    return q, k, v, s0


def _rounded(x, dtype):
    import torch

    return torch.as_tensor(x).to(getattr(torch, dtype)).double().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("e, m", GPU_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("segments", [None, 1, 7])
def test_gpu_causal_dot_product(e, m, dtype, segments):
    import torch

    q, k, v, s0 = gpu_inputs(e, m)
    tq, tk, tv = (torch.as_tensor(x, device="cuda").to(getattr(torch, dtype)) for x in (q, k, v))
    ts0 = torch.as_tensor(s0, device="cuda")
    with forced_segments(segments):
        out, state = numba_attn.causal_dot_product(tq, tk, tv, initial_state=ts0, return_state=True)
    ref, ref_state = reference.causal_dot_product(*(_rounded(x, dtype) for x in (q, k, v)), method="chunked",
                                                  chunk_size=256, initial_state=s0, return_state=True)
    assert out.dtype == tq.dtype and state.dtype == torch.float32
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    assert rel_error(state, ref_state) <= 1e-5


@pytest.mark.parametrize("e", [20, 64, 96, 128])  # E padded to 32 / 64 / 96 / 128: 8, 16, 24, 32 pieces per row
@pytest.mark.parametrize("strided, tf32, segments", [(None, False, 2), ("q", True, 1), ("k", False, None)])
def test_swizzled_float32_tiles(strided, tf32, segments, e):
    """float32 with E padded to a multiple of 32 takes swizzled Q / K tiles (``staging.tile_loader(swizzle=True)``,
    the kernel's XOR addressing): whole and partial chunks, cp.async and element-wise staging (a strided input),
    copies whose pieces per row divide the block's threads and ones that do not (E = 96), one and several segments,
    with a state in and out."""
    if SIM and e > 32:
        pytest.skip("the simulator runs the 8-piece rows; the GPU run covers the wider ones")
    n, m = (40, 16) if SIM else (3001, 64)
    rng = np.random.default_rng(11)
    q = make_array(rng, (1, 2, n, e), np.float32, strided == "q")
    k = make_array(rng, (1, 2, n, e), np.float32, strided == "k")
    v = make_array(rng, (1, 2, n, m), np.float32)
    s0 = rng.standard_normal((1, 2, e, m)).astype(np.float32)
    with forced_segments(segments):
        out, state = numba_attn.causal_dot_product(q, k, v, initial_state=s0, return_state=True, backend="chunked",
                                                   allow_tf32=tf32)
    ref, ref_state = reference.causal_dot_product(q, k, v, initial_state=s0, return_state=True)
    assert rel_error(to_host(out), ref) <= (ROUNDED_TF32_TOLERANCE if tf32 else 1e-5)
    assert rel_error(to_host(state), ref_state) <= (TF32_TOLERANCE if tf32 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("e", [72, 64])  # float32: E = 72 padded tiles, E = 64 swizzled ones
@pytest.mark.parametrize("dtype, kernel, tf32", [("float16", "registers", False), ("float16", "shared", False),
                                                 ("float32", "registers", False), ("float32", "registers", True),
                                                 ("float32", "shared", False)])
def test_gpu_poisoned_output_and_strided_inputs(dtype, kernel, tf32, e):
    """Call the launcher on NaN-filled outputs with strided CuPy views: every element written, values right."""
    import cupy as cp
    from numba import cuda

    m = 136  # two M tiles, the second partial
    rng = np.random.default_rng(5)
    q, k = (rng.standard_normal((2, 3, 777, e)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, 3, 777, m)).astype(dtype)
    base = cp.zeros((2, 777, 3, 2 * e), dtype=dtype)
    kd = base.transpose(0, 2, 1, 3)[..., ::2]
    kd[...] = cp.asarray(k)
    qd, vd = cp.asarray(q), cp.asarray(v)
    out = cp.full(v.shape, cp.nan, dtype=dtype)
    final = cp.full((2, 3, e, m), cp.nan, dtype=np.float32)
    ptr = cp.cuda.get_current_stream().ptr
    stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
    views = [cuda.as_cuda_array(x, sync=False) for x in (qd, kd, vd, out)]
    lc.launch_causal(*views, stream, final_state=cuda.as_cuda_array(final, sync=False), segments=5, kernel=kernel,
                     tf32=tf32)
    cp.cuda.get_current_stream().synchronize()
    ref, ref_state = reference.causal_dot_product(q, k, v, return_state=True)
    assert not cp.isnan(out).any() and not cp.isnan(final).any()
    # tf32: operands rounded (truncated ones, the tensor cores' default, give about 1.5e-3)
    assert rel_error(out, ref) <= (ROUNDED_TF32_TOLERANCE if tf32 else TOLERANCE[dtype])
    assert rel_error(final, ref_state) <= (TF32_TOLERANCE if tf32 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("e, m", [(64, 64), (256, 256)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_linear_attention(e, m, dtype, causal):
    import torch

    q, k, v, _ = gpu_inputs(e, m)
    tq, tk, tv = (torch.as_tensor(x, device="cuda").to(getattr(torch, dtype)) for x in (q, k, v))
    out = numba_attn.linear_attention(tq, tk, tv, causal=causal, backend="chunked")
    rq, rk, rv = (_rounded(x, dtype) for x in (q, k, v))
    ref = np.stack([np.stack([reference.linear_attention(rq[b, h], rk[b, h], rv[b, h], causal=causal)
                              for h in range(GPU_H)]) for b in range(GPU_B)])
    assert rel_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.gpu
def test_gpu_tf32_opt_in_is_close_and_long_positive_sums_stay_finite():
    import torch

    q, k, v, _ = gpu_inputs(64, 64)
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    out = numba_attn.causal_dot_product(tq, tk, tv, allow_tf32=True)
    ref = reference.causal_dot_product(q, k, v, method="chunked", chunk_size=256)
    # operands rounded to tf32 give about 4.5e-4 here; left to the tensor cores' truncation, about 1.5e-3
    assert rel_error(out, ref) <= ROUNDED_TF32_TOLERANCE
    # float16 inputs whose state entries pass the float16 range (65504): the state is kept in float32
    n = 40000
    ones = torch.full((1, 1, n, 16), 1.0, device="cuda", dtype=torch.float16)
    out = numba_attn.linear_attention(ones, ones, ones * 0.5, causal=True, eps=0.0)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), torch.full_like(out.float(), 0.5), rtol=1e-3)


@pytest.mark.parametrize("tf32", [False, True])
def test_nan_inputs_stay_nan(tf32):
    """A NaN in q poisons its own output row, a NaN in k every row from its position on (through the state); the
    other rows stay finite and right. The NaNs are 0x7FFFFFFF and 0xFFFFFFFF, the GPU's own NaN and its negation:
    a tf32 rounding by integer add would carry them into the sign bit and read them as zero."""
    n, e, m = (40, 16, 16) if SIM else (300, 64, 64)
    row_q, row_k = 9, n // 2 + 1
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 2, n, e)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, n, m)).astype(np.float32)
    ref = reference.causal_dot_product(q, k, v)  # the NaN-free values of the rows that must stay finite
    nan_pos, nan_neg = np.array([0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    q[0, 0, row_q, 3] = nan_pos
    k[0, 1, row_k, 5] = nan_neg
    out = to_host(numba_attn.causal_dot_product(q, k, v, backend="chunked", allow_tf32=tf32))
    assert np.isnan(out[0, 0, row_q]).all() and np.isnan(out[0, 1, row_k:]).all()
    finite = [out[0, 0, :row_q], out[0, 0, row_q + 1:], out[0, 1, :row_k]]
    expected = [ref[0, 0, :row_q], ref[0, 0, row_q + 1:], ref[0, 1, :row_k]]
    assert all(np.isfinite(x).all() for x in finite)
    for got, want in zip(finite, expected):
        assert rel_error(got, want) <= (ROUNDED_TF32_TOLERANCE if tf32 else 1e-5)


def test_dispatch_by_length_dtype_and_state():
    """backend=None: the sequential walk for short sequences, the chunked kernel for long ones, bfloat16 and states."""
    from numba_attn.linear import dispatch

    threshold = dispatch.CHUNKED_MIN_SEQLEN
    assert dispatch.choose_backend(None, "float16", threshold["float16"] - 1, False) == "recurrent"
    assert dispatch.choose_backend(None, "float16", threshold["float16"], False) == "chunked"
    assert dispatch.choose_backend(None, "float32", threshold["float32"] - 1, False) == "recurrent"
    assert dispatch.choose_backend(None, "float32", 1, True) == "chunked"
    assert dispatch.choose_backend(None, "bfloat16", 1, False) == "chunked"
    assert dispatch.choose_backend("recurrent", "float32", 1 << 20, False) == "recurrent"
