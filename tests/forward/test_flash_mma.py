"""The tensor-core flash kernel (numba_attn.forward.mma) against reference.attention.

* ``gpu`` tests: the real kernel (4 warps, 64-key tiles, inline PTX) on float16 and bfloat16 inputs over head dims
  16..256, causal or not, Lq != Lk both ways, GQA, tails, strided views, poisoned outputs.
* Simulator tests (skipped on a GPU, where the ``gpu`` tests cover more): the same kernel code on tiny tiles with
  the Python emulations of the intrinsics, so the fragment index arithmetic is checked without a GPU.
* The module must import under the simulator (no inline PTX is built there).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, device_view_in_layout, rel_error
from numba_attn.runtime.device import cuda, max_shared_per_block
from numba_attn.forward import mma as flash_mma
from numba_attn.core import ptx

POISON = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # quiet-NaN bit patterns

#: tiles small enough for the simulator (one warp, 16-key tiles, two passes above 32 columns)
TINY = flash_mma.SIMULATOR_CONFIG


def _bits_and_exact(x, dtype):
    """(uint16 bit pattern, exact float64 value) of float32 ``x`` rounded to ``dtype``."""
    if dtype == "float16":
        bits = x.astype(np.float16).view(np.uint16)
        return bits, bits.view(np.float16).astype(np.float64)
    bits = ptx.float32_to_bf16_bits(x)
    return bits, ptx.bf16_bits_to_float32(bits).astype(np.float64)


def _from_bits(bits, dtype):
    if dtype == "float16":
        return np.ascontiguousarray(bits).view(np.float16).astype(np.float64)
    return ptx.bf16_bits_to_float32(bits).astype(np.float64)


def _check(dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout="contig", config=None,
           seed=0, scale=1.0, sm_scale=None, bits_dtype=np.uint16, q_layout=None, launch=flash_mma.launch,
           out_pad=5):
    rng = np.random.default_rng(seed)

    def make(h, length, s):
        return _bits_and_exact((rng.standard_normal((batch, h, length, head_dim)) * s).astype(np.float32), dtype)

    (qb, qf), (kb, kf), (vb, vf) = make(heads, seqlen_q, scale), make(kv_heads, seqlen_k, scale), \
        make(kv_heads, seqlen_k, 1.0)
    q, k, v = (device_view_in_layout(x, lay) for x, lay in ((qb, q_layout or layout), (kb, layout), (vb, layout)))
    if bits_dtype != np.uint16:
        q, k, v = (x.view(bits_dtype) for x in (q, k, v))
    # a poisoned output buffer wider than headdim (by ``out_pad``; 5: rows aligned to no vector store): the kernel
    # must write [..., :D] and nothing else
    out_mem = cuda.to_device(np.full((batch, heads, seqlen_q, head_dim + out_pad), POISON[dtype], np.uint16))
    out = out_mem[:, :, :, :head_dim]
    lse = cuda.to_device(np.full((batch, heads, seqlen_q), np.nan, np.float32))
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    stream = 0 if numba_attn.SIMULATOR else cuda.default_stream()
    launch(q, k, v, out, lse, True, sm_scale, causal, stream, config=config, dtype=dtype)
    got_mem = out_mem.copy_to_host()
    assert np.all(got_mem[..., head_dim:] == POISON[dtype]), "wrote past headdim"
    got = _from_bits(got_mem[..., :head_dim], dtype)
    ref, ref_lse = reference.attention(qf, kf, vf, causal=causal, sm_scale=sm_scale, return_lse=True)
    assert rel_error(got, ref) < TOLERANCE[dtype]
    lse_host = lse.copy_to_host()
    assert_close_lse(lse_host, ref_lse)
    empty = np.isneginf(ref_lse)
    assert np.all(got[empty] == 0.0), "rows that see no key must be exactly 0"


# -- always --------------------------------------------------------------------------------------------------------
def test_module_imports_under_the_simulator():
    code = (
        "import numba_attn; assert numba_attn.SIMULATOR\n"
        "from numba_attn.forward import mma as flash_mma\nfrom numba_attn.core import ptx\n"
        "assert callable(ptx.mma_m16n8k16_f16) and callable(flash_mma.launch)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_bf16_bit_helpers_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -2.5, 3.0e38, 1e-40], np.float32)
    bits = ptx.float32_to_bf16_bits(x)
    # ties go to the even mantissa: 1 + 2^-8 -> 1.0, 1 + 3 * 2^-8 -> 1 + 2^-6
    np.testing.assert_array_equal(ptx.bf16_bits_to_float32(bits)[:4], [1.0, 1.0, 1.0 + 2.0 ** -6, -2.5])
    assert np.isfinite(ptx.bf16_bits_to_float32(bits)[4])


def test_tiles_fit_shared_memory_and_reject_bad_dims():
    config = flash_mma.DEFAULT_CONFIG
    for head_dim in range(1, 257):
        d = flash_mma.padded_head_dim(head_dim, config)
        tiles = flash_mma.tiles_for(config, d)
        assert d >= head_dim and tiles.shared_bytes <= max_shared_per_block()
        assert (tiles.row // 8) % 2 == 1  # an odd number of 16-byte pieces per row: ldmatrix reads conflict-free
        assert tiles.d_pass % 16 == 0  # whole ldmatrix.x4 column pairs per pass
    with pytest.raises(ValueError):
        flash_mma.tiles_for(config, 24)
    with pytest.raises(ValueError):
        flash_mma.tiles_for(config, 272)
    with pytest.raises(ValueError):
        flash_mma.tiles_for(config, 144)  # two passes need a multiple of 32


def test_configs_are_validated_where_made():
    for bad in (dict(warps=0), dict(warps=33), dict(m_tiles=0), dict(block_n=24), dict(block_n_wide=8),
                dict(max_single_pass_dim=40), dict(max_single_pass_dim=272), dict(min_warps=0), dict(stages=1),
                dict(warps=2.0)):
        with pytest.raises(ValueError, match="MmaConfig"):
            flash_mma.MmaConfig(**bad)


# -- simulator: the real kernel code on tiny tiles --------------------------------------------------------------------
simulator_only = pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")


@simulator_only
@pytest.mark.parametrize(
    "dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout",
    [
        ("float16", 2, 1, 21, 17, 16, True, "contig"),  # GQA, Lq > Lk: empty rows, tail tiles
        ("bfloat16", 1, 1, 9, 35, 13, False, "contig"),  # odd head dim: element loads, padded columns
        ("float16", 1, 1, 18, 18, 40, True, "blhd"),  # two passes over output halves, strided view
    ],
)
def test_simulated_kernel_equals_reference(dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout):
    _check(dtype, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout, config=TINY)


@simulator_only
def test_simulated_two_m_tiles_per_warp():
    # each K / V fragment feeds the MMAs of two 16-row tiles; 40 query rows: the second block's tiles end mid-way
    config = flash_mma.MmaConfig(warps=1, m_tiles=2, block_n=16, block_n_wide=16, max_single_pass_dim=32)
    _check("float16", 1, 1, 1, 40, 37, 16, True, config=config)


@simulator_only
def test_simulated_three_m_tiles_per_warp():
    # every m-tile gets its softmax (the kernel once ran it for m-tiles 0 and 1 only: P V of a third m-tile saw raw
    # scores); 53 query rows: the second block's third m-tile is partly past the end
    config = flash_mma.MmaConfig(warps=1, m_tiles=3, block_n=16, block_n_wide=16, max_single_pass_dim=32)
    _check("float16", 1, 1, 1, 53, 37, 16, True, config=config, seed=3)


@simulator_only
@pytest.mark.parametrize("stages", [3, 4])
def test_simulated_deeper_pipeline(stages):
    # the stage of tile j is j % stages and the prologue fills stages - 1 of them: 5 tiles of 16 keys with a tail,
    # fewer tiles than stages in the second block's causal range
    config = flash_mma.MmaConfig(warps=1, m_tiles=1, block_n=16, block_n_wide=16, max_single_pass_dim=32,
                                 stages=stages)
    _check("float16", 1, 1, 1, 20, 75, 16, True, config=config)


@simulator_only
def test_simulated_negative_scale():
    _check("float16", 1, 1, 1, 9, 20, 16, True, config=TINY, sm_scale=-0.3)


# -- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 59, 64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dtype, head_dim, causal):
    _check(dtype, 2, 4, 2, 200, 200, head_dim, causal, seed=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k",
    [(1, 1), (1, 1000), (63, 65), (65, 63), (1000, 1), (1000, 1000), (130, 64)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(seqlen_q, seqlen_k, causal):
    _check("float16", 1, 2, 1, seqlen_q, seqlen_k, 64, causal, seed=seqlen_q + seqlen_k)


@pytest.mark.gpu
@pytest.mark.parametrize("layout, head_dim", [("blhd", 128), ("pad3", 64), ("pad3", 111)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_views(layout, head_dim, dtype):
    _check(dtype, 2, 4, 2, 150, 170, head_dim, True, layout, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("q_layout", ["pad3", "blhd"])
def test_q_strided_kv_contiguous(q_layout):
    # Q, K and V go through one loader: a Q whose rows cannot be read in 16-byte pieces must turn the element copy
    # on for all three, even when K and V could take cp.async (it used to look at K and V only)
    _check("float16", 1, 4, 2, 190, 230, 64, True, "contig", seed=5, q_layout=q_layout)


@pytest.mark.gpu
def test_int16_bit_view_and_peaky_softmax():
    # torch's bfloat16 arrives as an int16 view; large logits exercise the running max
    _check("bfloat16", 1, 2, 2, 300, 300, 64, True, scale=3.0, sm_scale=0.3, bits_dtype=np.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_scale", [0.0, -0.4])
def test_scale_zero_or_negative(sm_scale):
    # the running max is kept on unscaled scores only for a positive scale; these take the scale-first kernel
    _check("float16", 1, 2, 1, 200, 230, 64, True, sm_scale=sm_scale, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_rows_many_tiles(head_dim):
    # many K/V tiles through both pipeline stages, Lq != Lk, a tail tile and a tail query block
    _check("bfloat16", 1, 2, 1, 1100, 3001, head_dim, True, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("stages, block_n", [(3, 64), (4, 32)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deeper_pipelines(stages, block_n, head_dim):
    # more tiles in flight (cp.async.wait_group stages - 2): a tail tile, Lq != Lk, and two passes at head dim 256
    config = flash_mma.MmaConfig(warps=4, m_tiles=1, block_n=block_n, block_n_wide=32, stages=stages)
    _check("float16", 1, 2, 1, 300, 1001, head_dim, True, config=config, seed=stages)


@pytest.mark.gpu
def test_vector_load_choice():
    a = cuda.device_array((2, 3, 40, 64), np.uint16)
    assert flash_mma.vector_loads_ok(a, a)
    assert not flash_mma.vector_loads_ok(cuda.device_array((2, 3, 40, 60), np.uint16))
    assert not flash_mma.vector_loads_ok(cuda.device_array((2, 3, 40, 67), np.uint16)[:, :, :, :64])
