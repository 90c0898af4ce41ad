"""The Hopper warpgroup kernel (numba_attn.forward.wgmma) against reference.attention.

* ``gpu`` tests (they skip themselves on GPUs older than sm_90): the real kernel (``wgmma.mma_async`` through inline
  PTX, 128-byte swizzled tiles, the softmax of one tile under the P V MMAs of the previous one) on float16 and
  bfloat16 inputs over head dims 8..128, causal or not, Lq != Lk both ways, GQA, tails, poisoned outputs; and the
  dispatch of ``flash_forward``.
* Simulator tests: the same kernel code with the Python twins of the intrinsics, which read the shared tiles through
  the documented descriptor layouts (swizzle included), so the layout and fragment arithmetic is checked without a
  GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
from numba_attn.forward import dispatch
from numba_attn.runtime.device import SIMULATOR, compute_capability, cuda
from numba_attn.forward import wgmma as flash_wgmma
from numba_attn.core import warpgroup as wgmma
from test_flash_mma import _check

TINY = flash_wgmma.SIMULATOR_CONFIG

hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < flash_wgmma.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma)")


def check(*args, config=None, **kwargs):
    _check(*args, launch=flash_wgmma.launch, config=config, **kwargs)


# -- always --------------------------------------------------------------------------------------------------------
def test_swizzle_permutes_the_pieces_of_each_row():
    # within every 1024-byte period the 16-byte pieces of a 128-byte row are permuted, never moved to another row,
    # and the 8 rows of one piece column land in 8 different bank groups
    rows = np.arange(8)[:, None]
    pieces = np.arange(8)[None, :]
    moved = wgmma.swizzle(128 * rows + 16 * pieces)
    assert np.all(moved // 128 == rows)
    assert all(sorted(moved[r] % 128 // 16) == list(range(8)) for r in range(8))
    assert all(len(set(moved[:, c] % 128 // 16)) == 8 for c in range(8))


def test_layouts_and_shared_memory():
    lbo, sbo, offsets = wgmma.k_major(64, 8)  # head dim 128: two atom columns of 64 rows
    assert sbo == 1024 and offsets == (0, 32, 64, 96, 8192, 8224, 8256, 8288)
    lbo, sbo, offsets = wgmma.mn_major(64, 4)
    assert (lbo, sbo, offsets) == (8192, 1024, (0, 2048, 4096, 6144))
    for head_dim in range(8, flash_wgmma.MAX_HEAD_DIM + 1, 8):
        d = flash_wgmma.padded_head_dim(head_dim)
        for config in flash_wgmma.TUNING_CANDIDATES:
            assert flash_wgmma.shared_bytes(config, d) <= 227 * 1024
    with pytest.raises(ValueError):
        wgmma.k_major(64, 3) and wgmma._check(64, 4, wgmma.k_major(64, 3))


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize(
    "dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal",
    [
        ("float16", 2, 1, 20, 37, 16, True),  # GQA, Lq < Lk, tail tiles, three V stages in turn
        ("bfloat16", 1, 1, 70, 33, 24, True),  # Lq > Lk: rows without keys; padded head dim, two query blocks
        ("float16", 1, 1, 9, 21, 72, False),  # two 128-byte atom columns (head dim padded to 80)
    ],
)
def test_simulated_kernel_equals_reference(dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal):
    check(dtype, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, config=TINY)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_simulated_negative_scale():
    check("float16", 1, 1, 1, 5, 40, 16, True, config=TINY, sm_scale=-0.3)


def test_grid_limits():
    from numba_attn.forward import mma as flash_mma

    flash_mma.check_grid(65535, 65535)
    with pytest.raises(ValueError, match="at most 65535"):
        flash_mma.check_grid(65536, 1)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_simulated_no_keys():
    check("float16", 1, 1, 1, 3, 0, 16, False, config=TINY)


def test_unsupported_inputs_are_refused():
    stream = 0 if SIMULATOR else cuda.default_stream()
    q = cuda.to_device(np.zeros((1, 1, 4, 60), np.float16))  # headdim % 8 != 0: the element loader of "mma"
    lse = cuda.to_device(np.zeros((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="wgmma kernel needs"):
        flash_wgmma.launch(q, q, q, q, lse, False, 0.1, False, stream)
    big = cuda.to_device(np.zeros((1, 1, 4, 136), np.float16))
    assert not flash_wgmma.supports("float16", 136, big)
    with pytest.raises(ValueError, match="backend: 'wgmma' takes float16 or bfloat16"):
        numba_attn.flash_forward(np.zeros((4, 16), np.float32), np.zeros((4, 16), np.float32),
                                 np.zeros((4, 16), np.float32), backend="wgmma")


# -- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 16, 48, 64, 72, 80, 96, 112, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dtype, head_dim, causal):
    check(dtype, 2, 4, 2, 200, 200, head_dim, causal, seed=head_dim)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k",
    [(1, 1), (1, 1000), (63, 65), (65, 63), (1000, 1), (1000, 1000), (130, 64), (64, 129), (70, 0)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(seqlen_q, seqlen_k, causal):
    check("float16", 1, 2, 1, seqlen_q, seqlen_k, 64, causal, seed=seqlen_q + seqlen_k)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", flash_wgmma.TUNING_CANDIDATES + (flash_wgmma.WgmmaConfig(32, 3),
                                                                   flash_wgmma.WgmmaConfig(16, 1)))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tile_configs_many_tiles(config, head_dim):
    # many K / V tiles through the 2 K and 3 V stages, Lq != Lk, a tail tile and a tail query block
    check("bfloat16", 1, 2, 1, 1100, 3001, head_dim, True, config=config, seed=11)
    check("float16", 2, 2, 2, 300, 257, head_dim, False, config=config, seed=12)


@pytest.mark.gpu
@hopper
def test_int16_bit_view_and_peaky_softmax():
    check("bfloat16", 1, 2, 2, 300, 300, 64, True, scale=3.0, sm_scale=0.3, bits_dtype=np.int16)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("sm_scale", [0.0, -0.4])
def test_scale_zero_or_negative(sm_scale):
    check("float16", 1, 2, 1, 200, 230, 64, True, sm_scale=sm_scale, seed=7)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("layout", ["blhd", "pad8"])
def test_strided_views_with_aligned_rows(layout):
    # (batch, seqlen, heads, headdim) views and rows padded by 8 elements still copy in 16-byte pieces
    check("float16", 2, 4, 2, 150, 170, 64, True, layout, seed=3)


@pytest.mark.gpu
@hopper
def test_flash_forward_dispatch(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("NUMBA_ATTN_AUTOTUNE", "0")  # one launch per call, whatever the environment asks (tuning
    # would time every candidate)
    calls = []
    launch = flash_wgmma.launch

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return launch(*args, **kwargs)

    flash_wgmma.launch = spy
    try:
        q = torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16)
        numba_attn.flash_forward(q, q, q)
        assert len(calls) == 1  # the default on Hopper
        numba_attn.flash_forward(q[..., :40], q[..., :40], q[..., :40])  # 16-byte aligned rows: still wgmma
        assert len(calls) == 2
        numba_attn.flash_forward(q[..., 1:61], q[..., 1:61], q[..., 1:61])  # misaligned rows: "mma"
        big = torch.randn(1, 2, 100, 160, device="cuda", dtype=torch.float16)
        numba_attn.flash_forward(big, big, big)  # head dim above 128: "mma"
        assert len(calls) == 2
        with pytest.raises(ValueError, match="wgmma kernel needs"):
            numba_attn.flash_forward(big, big, big, backend="wgmma")
    finally:
        flash_wgmma.launch = launch
    assert dispatch.choose_backend(None, "float16", wgmma_ok=True) == "wgmma"
    assert dispatch.choose_backend(None, "float16", wgmma_ok=False) == "mma"
