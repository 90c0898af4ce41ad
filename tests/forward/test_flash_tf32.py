"""The float32 tensor-core flash kernel (numba_attn.forward.tf32) against reference.attention.

* Simulator tests (skipped on a GPU, where the ``gpu`` tests cover more): the real kernel code on tiny tiles with the
  Python emulations of ``mma.sync.m16n8k8`` (tf32), ``cvt.rna.tf32`` and the shuffles, so the fragment mapping, the
  3xTF32 split, Q in registers / in shared memory, two passes, masks and strides are checked without a GPU.
  Measured there: 3xTF32 rel. error 0.9e-7 .. 1.7e-7 (bound 1e-5, the package's float32 tolerance), plain tf32
  about 4e-4 (bound 5e-3).
* ``gpu`` tests: realistic sizes (head dims 59 .. 256, up to 4k keys, GQA, strided views, both accuracy modes),
  among them 4096 keys at D = 128 non-causal, which catches error growing with the number of key tiles (the tensor
  cores' float32 accumulation is not round-to-nearest; the simulator's MMA twin is exact and cannot show it).
* Dispatch: float32 defaults to the SIMT kernel; ``backend="mma"`` or ``allow_tf32=True`` selects this one.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, device_view_in_layout, rel_error
from numba_attn.runtime.device import cuda, max_shared_per_block
from numba_attn.forward import common
from numba_attn.forward import tf32 as flash_tf32
from numba_attn.forward.tf32_split import SPLITS

#: plain tf32 (``allow_tf32=True``): 10 mantissa bits per operand, about 4e-4 on unit-variance inputs
TF32_TOLERANCE = 5e-3
TINY = flash_tf32.SIMULATOR_CONFIG
simulator_only = pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")


def _run(q, k, v, causal, *, tf32_only=False, layout="contig", config=None, sm_scale=None, q_layout=None):
    """The kernel's (out, lse) on a NaN-poisoned output wider than headdim; asserts only [..., :D] was written."""
    b, h, lq, d = q.shape
    out_mem = cuda.to_device(np.full((b, h, lq, d + 5), np.nan, np.float32))
    out = out_mem[:, :, :, :d]
    lse = cuda.to_device(np.full((b, h, lq), np.nan, np.float32))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    stream = 0 if numba_attn.SIMULATOR else cuda.default_stream()
    views = (device_view_in_layout(q, q_layout or layout), device_view_in_layout(k, layout),
             device_view_in_layout(v, layout))
    flash_tf32.launch(*views, out, lse, True, sm_scale, causal, stream, config=config, tf32_only=tf32_only)
    got_mem = out_mem.copy_to_host()
    assert np.isnan(got_mem[..., d:]).all(), "wrote past headdim"
    got = got_mem[..., :d]
    assert not np.isnan(got).any(), "an output element was not written"
    return got, lse.copy_to_host()


def _inputs(seed, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((batch, heads, seqlen_q, head_dim)) * scale).astype(np.float32)
    k = (rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)) * scale).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(np.float32)
    return q, k, v


def _check(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, *, tf32_only=False, layout="contig",
           config=None, seed=0, scale=1.0, sm_scale=None, q_layout=None):
    q, k, v = _inputs(seed, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, scale)
    got, lse = _run(q, k, v, causal, tf32_only=tf32_only, layout=layout, config=config, sm_scale=sm_scale,
                    q_layout=q_layout)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    ref, ref_lse = reference.attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    err = rel_error(got, ref)
    assert err < (TF32_TOLERANCE if tf32_only else TOLERANCE["float32"]), f"rel error {err:.2e}"
    assert_close_lse(lse, ref_lse, tol=TF32_TOLERANCE if tf32_only else 1e-5)
    empty = np.isneginf(ref_lse)
    assert np.all(got[empty] == 0.0), "rows that see no key must be exactly 0"
    return err


# -- always --------------------------------------------------------------------------------------------------------
def test_tiles_are_conflict_free_aligned_fit_and_unrollable():
    for tf32_only in (False, True):
        for d in range(1, 257):
            config = flash_tf32.gpu_config(d, tf32_only)
            tiles = flash_tf32.tiles_for(config, flash_tf32.padded_head_dim(d, config), tf32_only)
            assert tiles.d_pad >= d and tiles.d_pad % 8 == 0 and tiles.d_pass % 8 == 0
            assert tiles.k_stride % 16 == 8  # 8-byte Q / K fragment loads: two phases of 16 lanes, 32 banks each
            assert tiles.v_stride % 8 == 4  # 4-byte V fragment loads at 2t * stride + g: 32 banks
            # cp.async writes 16-byte pieces: every row and every tile starts on 16 bytes
            for words in (tiles.k_stride, tiles.v_stride, tiles.q_tile, tiles.k_tile, tiles.stage):
                assert words % 4 == 0
            assert tiles.shared_bytes <= max_shared_per_block()
            terms = 1 if tf32_only else 3
            nest = tiles.m_tiles * tiles.block_n * tiles.d_pad * terms // 64  # MMAs of S = Q K^T per tile
            assert nest <= config.max_pv_mmas or tiles.block_n == 8


def test_bad_tiles_are_rejected():
    with pytest.raises(ValueError, match="multiple of 8"):
        flash_tf32.tiles_for(flash_tf32.DEFAULT_CONFIG, 20)
    with pytest.raises(ValueError, match="multiple of 8"):
        flash_tf32.tiles_for(flash_tf32.DEFAULT_CONFIG, 264)
    with pytest.raises(ValueError, match="block_n"):
        flash_tf32.tiles_for(flash_tf32.Tf32Config(block_n=12), 64)
    with pytest.raises(ValueError, match="shared memory"):  # checked at launch, against the device's limit
        common.check_shared_memory(
            flash_tf32.tiles_for(flash_tf32.Tf32Config(warps=16, block_n=256, max_pv_mmas=10 ** 6), 256).shared_bytes)
    with pytest.raises(ValueError, match="unknown knob"):
        flash_tf32.DEFAULT_CONFIG.replace(block_m=3)


def test_launch_rejects_other_dtypes():
    x = cuda.to_device(np.zeros((1, 1, 4, 8), np.float16))
    lse = cuda.to_device(np.zeros((1, 1, 4), np.float32))
    with pytest.raises(TypeError, match="q: the tf32 tensor-core kernel takes float32"):
        flash_tf32.launch(x, x, x, x, lse, False, 1.0, False, 0)


def test_allow_tf32_must_be_a_bool():
    q, k, v = _inputs(0, 1, 1, 1, 4, 4, 8)
    with pytest.raises(TypeError, match="allow_tf32: expected True or False"):
        numba_attn.flash_forward(q, k, v, allow_tf32="yes")


# -- simulator: the real kernel code on tiny tiles --------------------------------------------------------------------
@simulator_only
@pytest.mark.parametrize(
    "heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout",
    [
        (2, 1, 21, 17, 5, True, "contig"),  # GQA, Lq > Lk (empty rows), tail tiles, Q in registers, padded columns
        (1, 1, 9, 35, 20, True, "blhd"),  # Lq < Lk causal, Q in shared memory, strided (transposed) view
        (1, 1, 10, 13, 40, False, "pad3"),  # two passes over output halves, rows of D + 3 elements
    ],
)
def test_simulated_kernel_equals_reference(heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout):
    _check(1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout=layout, config=TINY)


@simulator_only
@pytest.mark.parametrize(
    "heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout",
    [
        (2, 1, 37, 29, 24, True, "contig"),  # two m-tiles, cp.async (vector) loads, GQA, tails, Lq > Lk
        (1, 1, 20, 26, 48, False, "contig"),  # two passes over 24-column output halves with vector loads
    ],
)
def test_simulated_two_m_tiles(heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout):
    config = flash_tf32.Tf32Config(warps=1, m_tiles=2, block_n=8, max_single_pass_dim=32)
    _check(1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout=layout, config=config, seed=head_dim)


@simulator_only
def test_simulated_three_m_tiles():
    # every m-tile gets its softmax (the kernel once ran it for m-tiles 0 and 1 only)
    config = flash_tf32.Tf32Config(warps=1, m_tiles=3, block_n=8, max_single_pass_dim=32)
    _check(1, 1, 1, 53, 29, 8, True, config=config, seed=6)


@simulator_only
def test_simulated_tf32_mode_is_tf32_accurate_and_3x_is_float32_accurate():
    # the same inputs through both modes: 3xTF32 must beat plain tf32 by orders of magnitude, or the split is not
    # taking effect (an error of ~4e-4 would still pass a loose bound)
    err_1 = _check(1, 1, 1, 12, 20, 8, False, tf32_only=True, config=TINY, seed=4)
    err_3 = _check(1, 1, 1, 12, 20, 8, False, config=TINY, seed=4)
    assert err_1 > 1e-5 and err_3 < err_1 / 100


@simulator_only
@pytest.mark.parametrize("logit", [1e4, -1e4])
def test_simulated_huge_logits(logit):
    # scores of +-1e4: the running max must keep exp2 finite; with sm_scale = 1 one key dominates each row
    rng = np.random.default_rng(2)
    q = np.ones((1, 1, 6, 8), np.float32)
    k = (rng.standard_normal((1, 1, 11, 8)) * abs(logit)).astype(np.float32)
    k[..., 0] = np.sign(logit) * abs(logit) * 2
    v = rng.standard_normal((1, 1, 11, 8)).astype(np.float32)
    got, lse = _run(q, k, v, False, config=TINY, sm_scale=1.0)
    ref, ref_lse = reference.attention(q, k, v, sm_scale=1.0, return_lse=True)
    assert np.isfinite(lse).all()
    assert rel_error(got, ref) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse, tol=1e-6)


@functools.lru_cache(maxsize=None)
def _split_run(case, split, warps=1, m_tiles=1):
    """(out, lse) of one simulator case (``SPLIT_CASES``) under ``Tf32Config.split = split``."""
    heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal = SPLIT_CASES[case]
    q, k, v = _inputs(case, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    config = TINY.replace(split=split, warps=warps, m_tiles=m_tiles)
    got, lse = _run(q, k, v, causal, config=config)
    ref = reference.attention(q, k, v, causal=causal)
    assert rel_error(got, ref) < TOLERANCE["float32"]
    return got, lse


SPLIT_CASES = {
    0: (2, 1, 9, 12, 16, True),  # GQA, Lq < Lk causal, tail tile, cp.async loads
    1: (1, 1, 5, 8, 40, False),  # two passes over 24-column output halves (the V split of each pass)
    2: (1, 1, 40, 8, 8, False),  # with 2 warps x 2 m-tiles: the split Q tile's rows of every warp and m-tile
}


@simulator_only
@pytest.mark.parametrize("case, split, warps, m_tiles", [
    (0, "warp", 1, 1), (0, "q", 1, 1), (0, "kv", 1, 1), (1, "qkv", 1, 1), (2, "qkv", 2, 2)])
def test_simulated_splits_equal_cvt_bit_for_bit(case, split, warps, m_tiles):
    # every split mode splits a finite value into the same (hi, lo) as cvt.rna (tf32_split): only where the split
    # happens and how the split tiles are laid out differ, and a wrong offset would not give the same bits
    got, lse = _split_run(case, split, warps, m_tiles)
    want, want_lse = _split_run(case, "cvt", warps, m_tiles)
    assert np.array_equal(got, want) and np.array_equal(lse, want_lse)


def test_split_modes_fit_two_blocks_per_sm_up_to_d128():
    for split in SPLITS:
        for d in range(1, 257):
            config = flash_tf32.gpu_config(d, split=split)
            tiles = flash_tf32.tiles_for(config, flash_tf32.padded_head_dim(d, config))
            assert tiles.split == split and tiles.shared_bytes <= max_shared_per_block()
            for words in (tiles.q_tile, tiles.k_tile, tiles.stage, tiles.raw_k, tiles.kv_words):
                assert words % 4 == 0  # 16-byte cp.async pieces and 16-byte split chunks
            if tiles.d_pad <= 128:  # 228 KiB per SM on an H100, 1 KiB of it reserved per block
                assert 2 * (tiles.shared_bytes + 1024) <= 228 * 1024, (split, d, tiles.shared_bytes)
        # tf32_only ignores split: one kernel, the "cvt" one
        assert flash_tf32.tiles_for(flash_tf32.gpu_config(64, True, split), 64, True).split == "cvt"
    with pytest.raises(ValueError, match="split"):
        flash_tf32.Tf32Config(split="none")


def test_float32_dispatch():
    # float32 defaults to the 3xTF32 tensor-core kernel on a GPU (float32 accuracy, measured faster than the SIMT
    # kernel and than torch's float32 path on an H100, 2026-11-22) and to the SIMT kernel under the simulator (no
    # MMA emulation); allow_tf32=True picks the tensor-core kernel's one-term mode; backend= forces a kernel
    from numba_attn.forward import dispatch

    if not numba_attn.SIMULATOR and dispatch.compute_capability() < flash_tf32.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    assert dispatch.choose_backend(None, "float32") == ("simt" if numba_attn.SIMULATOR else "mma")
    assert dispatch.choose_backend(None, "float32", allow_tf32=True) == "mma"
    assert dispatch.choose_backend("mma", "float32") == "mma"
    assert dispatch.choose_backend("simt", "float32", allow_tf32=True) == "simt"
    assert dispatch.choose_backend(None, "float16") == "mma"
    assert dispatch.choose_backend(None, "float16", allow_tf32=True) == "mma"


@simulator_only
def test_simulated_api_defaults_to_simt_and_allow_tf32_picks_the_tensor_core_kernel():
    q, k, v = _inputs(5, 1, 2, 1, 7, 9, 6)
    ref = reference.attention(q, k, v, causal=True)
    default = numba_attn.flash_forward(q, k, v, causal=True)
    simt = numba_attn.flash_forward(q, k, v, causal=True, backend="simt")
    simt_tf32 = numba_attn.flash_forward(q, k, v, causal=True, backend="simt", allow_tf32=True)  # ignored by simt
    exact = numba_attn.flash_forward(q, k, v, causal=True, backend="mma")
    rough = numba_attn.flash_forward(q, k, v, causal=True, allow_tf32=True)
    rough_mma = numba_attn.flash_forward(q, k, v, causal=True, backend="mma", allow_tf32=True)
    assert np.array_equal(default, simt) and np.array_equal(simt_tf32, simt)
    assert np.array_equal(rough, rough_mma)
    assert rel_error(exact, ref) < TOLERANCE["float32"] and rel_error(simt, ref) < TOLERANCE["float32"]
    assert TOLERANCE["float32"] < rel_error(rough, ref) < TF32_TOLERANCE


# -- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 59, 64, 80, 111, 128, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tf32_only", [False, True])
def test_head_dims(head_dim, causal, tf32_only):
    _check(2, 4, 2, 300, 300, head_dim, causal, tf32_only=tf32_only, seed=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k",
    [(1, 1), (1, 2000), (63, 65), (65, 63), (2000, 1), (2048, 2048), (130, 64), (777, 1531)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(seqlen_q, seqlen_k, causal):
    _check(1, 2, 1, seqlen_q, seqlen_k, 64, causal, seed=seqlen_q + seqlen_k)


@pytest.mark.gpu
@pytest.mark.parametrize("layout, head_dim", [("blhd", 128), ("pad3", 64), ("pad3", 111), ("blhd", 256)])
def test_strided_views(layout, head_dim):
    _check(2, 4, 2, 150, 170, head_dim, True, layout=layout, seed=3)


@pytest.mark.gpu
def test_peaky_softmax():
    _check(1, 2, 2, 1000, 1000, 64, True, scale=3.0, sm_scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (256, False)])
@pytest.mark.parametrize("tf32_only", [False, True])
def test_long_sequences(head_dim, causal, tf32_only):
    n = 4096
    q, k, v = _inputs(9, 1, 4, 2, n, n, head_dim)
    got, _ = _run(q, k, v, causal, tf32_only=tf32_only)
    rows = np.r_[0:16, n // 2 : n // 2 + 16, n - 16 : n]
    ref = reference.attention(q, k, v, causal=causal, rows=rows)
    err = rel_error(got[:, :, rows], ref)
    assert err < (TF32_TOLERANCE if tf32_only else TOLERANCE["float32"]), f"rel error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("warps, m_tiles, block_n", [(8, 1, 24), (4, 1, 16), (2, 2, 32), (4, 2, 8), (1, 2, 16)])
def test_other_tiles(warps, m_tiles, block_n):
    config = flash_tf32.Tf32Config(warps=warps, m_tiles=m_tiles, block_n=block_n)
    _check(1, 4, 2, 333, 257, 96, True, config=config, seed=warps)


@pytest.mark.gpu
@pytest.mark.parametrize("q_layout", ["pad3", "blhd"])
def test_q_strided_kv_contiguous(q_layout):
    # Q, K and V go through one loader: a Q whose rows cannot be read in 16-byte pieces must turn the element copy
    # on for all three, even when K and V could take cp.async
    _check(1, 4, 2, 190, 230, 64, True, layout="contig", q_layout=q_layout, seed=5)


@pytest.mark.gpu
def test_many_key_tiles_keep_float32_accuracy():
    # 4096 keys = 256 tiles of 16. The tensor cores' float32 accumulation does not round to nearest: with O fed as
    # the C operand of every tile's P V MMAs the error grew with the number of tiles (H100, 2026-11-22, D = 128
    # non-causal: 1.5e-5 at 2k keys, 3.0e-5 at 4k). Each tile's P V now goes into fresh accumulators and is added
    # to O in float32 FMAs. (The simulator's MMA twin rounds exactly, so only a GPU can catch this.)
    n, head_dim = 4096, 128
    q, k, v = _inputs(13, 1, 4, 4, n, n, head_dim)
    got, _ = _run(q, k, v, False)
    rows = np.r_[0:16, n // 2 : n // 2 + 16, n - 16 : n]
    ref = reference.attention(q, k, v, causal=False, rows=rows)
    err = rel_error(got[:, :, rows], ref)
    assert err <= 1e-5, f"rel error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS[1:])
@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, True), (128, False), (59, True)])
def test_split_modes(split, head_dim, causal):
    # each split mode with its own tiles (gpu_config); scripts/check_tf32.py --compare-split times them
    _check(2, 4, 2, 300, 333, head_dim, causal, config=flash_tf32.gpu_config(head_dim, split=split), seed=head_dim)


@pytest.mark.gpu
def test_api_float32_default_is_3xtf32_mma():
    cupy = pytest.importorskip("cupy")
    q, k, v = _inputs(11, 2, 4, 2, 1000, 1000, 128)
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    ref = reference.attention(q, k, v, causal=True)
    outs = {}
    for name, kwargs in {"default": {}, "simt": {"backend": "simt"}, "mma": {"backend": "mma"},
                         "tf32": {"allow_tf32": True}, "mma_tf32": {"backend": "mma", "allow_tf32": True}}.items():
        outs[name] = numba_attn.flash_forward(dq, dk, dv, causal=True, **kwargs).get()
    errs = {name: rel_error(out, ref) for name, out in outs.items()}
    assert np.array_equal(outs["default"], outs["mma"])  # float32 defaults to the 3xTF32 tensor-core kernel
    assert np.array_equal(outs["tf32"], outs["mma_tf32"])  # allow_tf32=True opts into the tensor-core kernel
    assert errs["simt"] < TOLERANCE["float32"] and errs["mma"] < TOLERANCE["float32"]
    # plain tf32 is measurably rougher, which shows backend="mma" really is the 3xTF32 kernel
    assert errs["mma"] * 100 < errs["tf32"] < TF32_TOLERANCE
