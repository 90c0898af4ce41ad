"""The warpgroup backward (``backend="wgmma"``, numba_attn/backward/wgmma.py) against reference.attention_backward.

* Simulator tests (one warpgroup, 64-key blocks, 64-row query tiles, the ``core.warpgroup`` twins, which read the
  swizzled tiles through the documented descriptor layouts): through ``dispatch`` on host arrays (float16, and
  bfloat16 as bit patterns), outputs and scratch poisoned with NaN; causal with Lq != Lk both ways, GQA, lengths no
  tile divides, a padded head dim, a negative scale, the deterministic ``dq`` of ``backward.mma``, and two
  warpgroups (how the warpgroups share ``dQ``; 128-row tiles were checked by hand only, to keep CI short); ``dQ`` by
  whole-tile bulk reductions (the default, ``core.dq_tile``; more in test_flash_backward_dq_tile.py) or per-thread
  reductions (scalar, or v4 after a lane exchange).
* The warp-specialised kernel (``backend="wgmma_ws"``, numba_attn/backward/wgmma_ws.py) the same way, its copies by
  the simulated TMA / bulk copies and mbarriers of ``core.ptx.tma`` / ``bulk``.
* ``gpu`` tests (sm_90 only): realistic sizes, float16 and bfloat16, head dims 64 / 128, each gradient's error
  against the float64 reference at most twice torch SDPA's own in the same dtype.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error
from numba_attn.backward import dispatch
from numba_attn.backward import wgmma as backward_wgmma
from numba_attn.backward import wgmma_ws as backward_wgmma_ws
from numba_attn.runtime.device import SIMULATOR, compute_capability
from test_flash_backward_mma import _as_float, _bits_backward, _case, _check, _torch_error

hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < backward_wgmma.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma)")


# (backend, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, sm_scale, tiles)
SIMULATED = [
    # GQA 2:1, Lq < Lk, two query tiles and two key blocks, neither length a multiple of 64 (dQ tiles: rows 70..127
    # padding, d_pad 16's permutation)
    ("wgmma", "float16", 2, 1, 70, 90, 16, True, False, None, {}),
    # Lq > Lk: rows that see no key (lse = -inf); bfloat16; head dim 24 padded to 32; dQ by v4 reductions (lane
    # exchange; the quad of columns 20..23 crosses no row end, 24..27 is left out)
    ("wgmma", "bfloat16", 1, 1, 90, 40, 24, True, False, None, dict(dq_quads=True, dq_bulk=False)),
    # a negative scale, not causal; the deterministic dq of the query-block kernel
    ("wgmma", "float16", 1, 1, 20, 70, 16, False, True, -0.5, {}),
    # two warpgroups (128-key blocks) sharing each tile's dQ by column halves; one barrier per tile, dK from the
    # dS^T tile
    ("wgmma", "float16", 1, 1, 30, 100, 16, True, False, None, dict(warpgroups=2, stages=3, one_barrier=True,
                                                                    dk_smem=True, dq_bulk=False)),
    # warp-specialised: TMA / bulk copies through the mbarrier ring (two stages over three query tiles of two
    # heads), the dQ writer warp's bulk reductions, GQA, causal Lq < Lk
    ("wgmma_ws", "float16", 2, 1, 70, 90, 16, True, False, None, {}),
    # bfloat16, Lq > Lk, P^T under dP^T (not fused), dQ by the consumers' v4 reductions, two consumers
    ("wgmma_ws", "bfloat16", 1, 1, 90, 40, 32, True, False, None, dict(consumers=2, fused_grads=False,
                                                                       dq_writer=False, dq_quads=True)),
]


@pytest.mark.skipif(not SIMULATOR, reason="host arrays through the internals: simulator only (GPU: test_gpu_*)")
@pytest.mark.parametrize("backend,dtype,heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,deterministic,sm_scale,"
                         "tiles", SIMULATED)
def test_simulated_kernel_equals_reference(monkeypatch, backend, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                           causal, deterministic, sm_scale, tiles):
    module = backward_wgmma if backend == "wgmma" else backward_wgmma_ws
    if tiles:
        monkeypatch.setattr(module, "SIMULATOR_CONFIG", dataclasses.replace(module.SIMULATOR_CONFIG, **tiles))
    inputs, exact = _case(seqlen_q * 100 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, causal,
                          sm_scale)
    grads = _bits_backward(inputs, causal, sm_scale, deterministic, dtype, backend=backend)
    refs = _check(grads, exact, causal, sm_scale, dtype)
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0
        np.testing.assert_array_equal(_as_float(grads[0], dtype)[:, :, :seqlen_q - seqlen_k], 0.0)
        np.testing.assert_array_equal(refs[0][:, :, :seqlen_q - seqlen_k], 0.0)


def test_backend_choice_and_config():
    if SIMULATOR:
        assert dispatch.choose_backend("wgmma", "float16", 128) == "wgmma"
        assert dispatch.choose_backend(None, "bfloat16", 64) == "mma"  # the default stays "mma" there
    elif compute_capability() >= backward_wgmma.MIN_COMPUTE_CAPABILITY:  # the measured defaults on sm_90
        assert dispatch.choose_backend(None, "bfloat16", 64) == "wgmma_ws"
        assert dispatch.choose_backend(None, "float16", 32) == "wgmma_ws"
        assert dispatch.choose_backend(None, "bfloat16", 128) == "wgmma_ws"
        assert dispatch.choose_backend(None, "float16", 96) == "wgmma_ws"
        assert backward_wgmma.default_config(128).dq_tiled and backward_wgmma_ws.default_config(64).dq_tiled
    with pytest.raises(ValueError, match="'wgmma' takes float16 or bfloat16 with headdim <= 128"):
        dispatch.choose_backend("wgmma", "float16", 160)
    with pytest.raises(ValueError, match="'wgmma' takes float16 or bfloat16"):
        dispatch.choose_backend("wgmma", "float32", 64)
    for kwargs, match in ((dict(block_m=96), "block_m"), (dict(warpgroups=0), "warpgroups"),
                          (dict(warpgroups=3, block_m=128), "divide one another"), (dict(stages=1), "stages")):
        with pytest.raises(ValueError, match=match):
            backward_wgmma.WgmmaBackwardConfig(**kwargs)
    assert [backward_wgmma.padded_head_dim(d) for d in (8, 16, 24, 64, 72, 128)] == [16, 16, 32, 64, 128, 128]
    for config in backward_wgmma.GPU_CANDIDATES.values():  # every candidate fits an sm_90 block at 64 and 128
        for d_pad in (64, 128):
            if not (config.block_m == 128 and d_pad == 128):
                assert config.shared_bytes(d_pad) <= 227 * 1024, (config, d_pad)


# -- realistic sizes, on a GPU only ---------------------------------------------------------------------------------
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("backend", ["wgmma", "wgmma_ws"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_against_reference_and_torch(backend, dtype, head_dim, causal, deterministic):
    torch = pytest.importorskip("torch")
    inputs, exact = _case(15, 4, 2, 1000, 777, head_dim, dtype, causal, batch=2)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tensors = [torch.tensor(_as_float(x, dtype), device="cuda", dtype=tdt) for x in inputs[:5]]
    tensors.append(torch.tensor(inputs[5], device="cuda"))
    grads = numba_attn.flash_backward(*tensors, causal=causal, deterministic=deterministic, backend=backend)
    grads = [g.float().cpu().numpy() for g in grads]
    refs = reference.attention_backward(*exact, causal=causal)
    theirs = _torch_error(exact, causal, dtype, refs)
    for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, refs, theirs or [None] * 3):
        err = rel_error(g, ref)
        limit = 2 * bound if bound is not None else TOLERANCE[dtype]
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:.3g} (torch SDPA: {bound})"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", [(1, 300, 128), (129, 3, 64), (777, 2048, 32),
                                                        (2048, 2048, 96), (4096, 333, 128)])
def test_gpu_lengths_and_head_dims(seqlen_q, seqlen_k, head_dim):
    inputs, exact = _case(18, 4, 1, seqlen_q, seqlen_k, head_dim, "float16", True)
    for backend in ("wgmma", "wgmma_ws"):
        _check(numba_attn.flash_backward(*inputs, causal=True, backend=backend), exact, True, None, "float16")
