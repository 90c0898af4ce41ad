"""The whole-tile ``dQ`` of the warpgroup backwards (``core.dq_tile``: one bulk reduction per staged tile, the
accumulator's columns permuted): ``wgmma``'s ``dq_bulk`` and ``wgmma_ws``'s ``dq_writer`` with one or two staging
tiles, against reference.attention_backward.

* The layout itself: a permutation of each row that keeps column pairs, free of bank conflicts for the consumers'
  8-byte fragment stores at every padded head dim.
* ``convert`` reading the tiled layout, ``preprocess`` zeroing the whole padded accumulator (NaN-poisoned).
* Simulator runs through ``dispatch`` (outputs and scratch poisoned with NaN, ``_bits_backward``; the twins of the
  bulk reductions read their staging tile as late as allowed, ``ptx.bulk``): query lengths no tile divides (the
  last tile's padding rows), Lq != Lk both ways, causal or not, GQA, head dims padded 16 -> 16 / 24 -> 32 (both
  permutations), one and two warpgroups sharing a tile (column halves), one and two staging tiles.
* ``gpu`` (sm_90): the named candidates at realistic sizes against the reference and torch.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error
from numba_attn.backward import convert, preprocess
from numba_attn.core.ptx import bf16_bits_to_float32, float32_to_bf16_bits
from numba_attn.backward import wgmma as backward_wgmma
from numba_attn.backward import wgmma_ws as backward_wgmma_ws
from numba_attn.core import dq_tile
from numba_attn.runtime.device import SIMULATOR, compute_capability
from test_flash_backward_mma import _as_float, _bits_backward, _case, _check, _torch_error


@pytest.mark.parametrize("d_pad", [16, 32, 64, 128])
def test_layout_is_a_conflict_free_permutation(d_pad):
    for row in range(8):
        columns = [c ^ dq_tile.swizzle(row, d_pad) for c in range(d_pad)]
        assert sorted(columns) == list(range(d_pad))  # a permutation of the row
        assert all(columns[c + 1] == columns[c] + 1 for c in range(0, d_pad, 2))  # pairs stay aligned pairs
    for width in {d_pad, d_pad // 2, 8} - {0}:  # a warpgroup's column slice (warpgroups splitting the columns)
        for c0 in range(0, d_pad, width):
            for nb in range(width // 8):
                for phase in range(2):  # lanes 0-15, 16-31 of a warp's 8-byte stores: rows g, columns 8 nb + 2t
                    banks = []
                    for lane in range(16 * phase, 16 * phase + 16):
                        g, t = lane // 4, lane % 4
                        word = g * d_pad + ((c0 + 8 * nb + 2 * t) ^ dq_tile.swizzle(g, d_pad))
                        banks += [word % 32, (word + 1) % 32]
                    assert len(set(banks)) == 32, (d_pad, width, c0, nb, phase)
    assert dq_tile.padded_rows(70, 64) == 128 and dq_tile.padded_rows(0, 64) == 0
    with pytest.raises(ValueError, match="dq_acc"):
        dq_tile.check_accumulator(np.zeros((1, 1, 70, 32), np.float32), 70, 64, 32)
    with pytest.raises(ValueError, match="d_pad"):
        dq_tile.tile_swizzle(48)


@pytest.mark.skipif(not SIMULATOR, reason="host arrays: simulator only")
@pytest.mark.parametrize("d_pad,head_dim,bf16", [(16, 16, False), (32, 24, True)])
def test_convert_reads_the_tiled_layout(d_pad, head_dim, bf16):
    rng = np.random.default_rng(d_pad)
    logical = rng.standard_normal((1, 2, 10, d_pad)).astype(np.float32)
    tiled = np.empty_like(logical)
    for row in range(10):
        tiled[:, :, row, [c ^ dq_tile.swizzle(row, d_pad) for c in range(d_pad)]] = logical[:, :, row]
    dst = np.full((1, 2, 10, head_dim), 0xFFFF if bf16 else np.nan, np.uint16 if bf16 else np.float16)
    convert.launch(tiled, dst, 0, bf16=bf16, tiled=True)
    expect = logical[..., :head_dim]
    got = _as_float(dst, "bfloat16" if bf16 else "float16")
    np.testing.assert_allclose(got, expect, rtol=1e-2 if bf16 else 1e-3)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator twins")
def test_simulated_bulk_reductions_read_their_source_at_the_wait():
    from numba_attn.core.ptx import bulk

    smem = np.zeros(32, np.uint16)
    staged = smem.view(np.float32)
    dst = np.zeros((4, 4), np.float32)
    staged[:] = 1.0
    bulk.bulk_reduce_add_f32(dst, 1, smem, 0, 32)  # 8 floats: rows 1 and 2 (contiguous rows)
    bulk.bulk_commit()
    staged[:] = 2.0  # written again before any wait: the copy may read this
    bulk.bulk_wait_read1()  # the newest group may still be pending
    assert not dst.any()
    bulk.bulk_wait_read()
    np.testing.assert_array_equal(dst, np.repeat([0.0, 2.0, 2.0, 0.0], 4).reshape(4, 4))


@pytest.mark.skipif(not SIMULATOR, reason="host arrays: simulator only")
def test_preprocess_zeroes_the_padded_accumulator():
    out = np.ones((1, 1, 5, 24), np.float16)
    stats = np.full((1, 1, 8, 4), np.nan, np.float32)
    dq_acc = np.full((1, 1, 16, 32), np.nan, np.float32)  # rows and columns past q's
    preprocess.launch(out, out, stats, dq_acc, 0, lse=np.zeros((1, 1, 5), np.float32))
    np.testing.assert_array_equal(dq_acc, 0.0)


@pytest.mark.skipif(not SIMULATOR, reason="host arrays: simulator only")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("head_dim,vector", [(24, True), (64, True), (20, False)])
def test_preprocess_stats_with_and_without_16_byte_loads(bf16, head_dim, vector):
    """``D = rowsum(dout * out)`` and ``lse log2 e`` per row, equal to float64 whichever loads the rows take (16-byte
    pieces where the rows allow them, ``vector_rows``; element by element otherwise), poisoned stats first; rows
    past q's and a row that sees no key give ``(+inf, 0)``."""
    rng = np.random.default_rng(head_dim)
    shape = (2, 3, 7, head_dim)
    out, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if bf16:
        out_in, dout_in = float32_to_bf16_bits(out), float32_to_bf16_bits(dout)
        out64, dout64 = (bf16_bits_to_float32(x).astype(np.float64) for x in (out_in, dout_in))
    else:
        out_in, dout_in = out.astype(np.float16), dout.astype(np.float16)
        out64, dout64 = out_in.astype(np.float64), dout_in.astype(np.float64)
    assert preprocess.vector_rows(out_in, dout_in) == vector
    lse = rng.standard_normal(shape[:3]).astype(np.float32)
    lse[1, 2, 3] = -np.inf  # a row that sees no key
    stats = np.full((2, 3, 4, 4), np.nan, np.float32)  # 8 rows: one past q's
    preprocess.launch(out_in, dout_in, stats, None, 0, bf16=bf16, lse=lse)
    pairs = stats.reshape(2, 3, 8, 2)
    expect_d = (out64 * dout64).sum(-1)
    np.testing.assert_allclose(pairs[:, :, :7, 1], expect_d, rtol=1e-5, atol=1e-5)
    expect_lse = np.where(np.isneginf(lse), np.inf, lse.astype(np.float64) * np.log2(np.e))
    np.testing.assert_allclose(pairs[:, :, :7, 0], expect_lse, rtol=1e-6)
    np.testing.assert_array_equal(pairs[:, :, 7], np.broadcast_to([np.inf, 0.0], (2, 3, 2)))


# (backend, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, tiles: SIMULATOR_CONFIG changes)
SIMULATED = [
    # (GQA, causal Lq < Lk, two tiles per head, d_pad 16, the default dq_bulk: test_flash_backward_wgmma's first case)
    # Lq > Lk, rows that see no key; head dim 24 in 32 columns (logical columns < 24 stored past 24); one staging tile
    ("wgmma", "bfloat16", 1, 1, 90, 40, 24, True, dict(dq_bulk=True, dq_buffers=1)),
    # two warpgroups staging column halves of one tile, one bulk reduction for both
    ("wgmma", "float16", 1, 1, 30, 100, 16, True, dict(warpgroups=2, dq_bulk=True)),
    # one staging tile, four walk tiles (GQA), not causal, Lq > Lk, d_pad 32
    ("wgmma_ws", "bfloat16", 2, 1, 100, 40, 32, False, dict(dq_writer=True, dq_buffers=1)),
    # two consumers staging column halves, two staging tiles
    ("wgmma_ws", "float16", 1, 1, 130, 70, 16, True, dict(consumers=2, dq_writer=True, dq_buffers=2)),
]


@pytest.mark.skipif(not SIMULATOR, reason="host arrays through the internals: simulator only (GPU: test_gpu_*)")
@pytest.mark.parametrize("backend,dtype,heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,tiles", SIMULATED)
def test_simulated_tiled_dq_equals_reference(monkeypatch, backend, dtype, heads, kv_heads, seqlen_q, seqlen_k,
                                            head_dim, causal, tiles):
    module = backward_wgmma if backend == "wgmma" else backward_wgmma_ws
    config = dataclasses.replace(module.SIMULATOR_CONFIG, **tiles)
    assert config.dq_tiled
    monkeypatch.setattr(module, "SIMULATOR_CONFIG", config)
    inputs, exact = _case(seqlen_q * 100 + seqlen_k + 7, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, causal)
    grads = _bits_backward(inputs, causal, None, False, dtype, backend=backend)
    refs = _check(grads, exact, causal, None, dtype)
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0
        np.testing.assert_array_equal(_as_float(grads[0], dtype)[:, :, :seqlen_q - seqlen_k], 0.0)
        np.testing.assert_array_equal(refs[0][:, :, :seqlen_q - seqlen_k], 0.0)


def test_config_checks():
    with pytest.raises(ValueError, match="dq_buffers"):
        backward_wgmma_ws.WsBackwardConfig(dq_buffers=3)
    assert not backward_wgmma.WgmmaBackwardConfig().dq_tiled  # the default keeps the per-thread reductions
    assert backward_wgmma.GPU_CANDIDATES["g2m64tile"].dq_tiled
    with pytest.raises(ValueError, match="dq_buffers"):
        backward_wgmma.WgmmaBackwardConfig(dq_buffers=0)
    for name in ("tile", "tile1buf"):
        config = backward_wgmma_ws.GPU_CANDIDATES[name]
        assert config.dq_tiled and config.shared_bytes(128) <= 227 * 1024, name


hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < backward_wgmma.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma)")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("backend,name", [("wgmma", "g2m64tile"), ("wgmma", "g2m64tilek"), ("wgmma_ws", "tile"),
                                          ("wgmma_ws", "tile1buf")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tiled_dq_against_reference_and_torch(monkeypatch, backend, name, dtype, head_dim, causal):
    torch = pytest.importorskip("torch")
    module = backward_wgmma if backend == "wgmma" else backward_wgmma_ws
    config = module.GPU_CANDIDATES[name]
    monkeypatch.setattr(module, "default_config", lambda head_dim=128: config)
    inputs, exact = _case(16, 4, 2, 1000, 777, head_dim, dtype, causal, batch=2)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tensors = [torch.tensor(_as_float(x, dtype), device="cuda", dtype=tdt) for x in inputs[:5]]
    tensors.append(torch.tensor(inputs[5], device="cuda"))
    grads = [g.float().cpu().numpy() for g in numba_attn.flash_backward(*tensors, causal=causal, backend=backend)]
    refs = reference.attention_backward(*exact, causal=causal)
    theirs = _torch_error(exact, causal, dtype, refs)
    for label, g, ref, bound in zip(("dq", "dk", "dv"), grads, refs, theirs or [None] * 3):
        err = rel_error(g, ref)
        limit = 2 * bound if bound is not None else TOLERANCE[dtype]
        assert err <= limit, f"{label}: relative error {err:.3g} > {limit:.3g} (torch SDPA: {bound})"
