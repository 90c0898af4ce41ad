"""The float8 e4m3 forward on the warp-specialised kernel (numba_attn.forward.wgmma_ws_fp8: ``wgmma_ws``'s ``fp8``
variant) against reference.attention_fp8 and reference.flash_fp8_model, with ``test_flash_fp8.check`` (its error
bounds and their reasons): what only this kernel has. ``test_flash_fp8`` runs the checks both fp8 kernels share
(simulated kernel; on a GPU head dims, lengths, GQA, descale kinds, tile configurations, window and softcap).

* Always: configurations and shared memory, refused inputs.
* Simulator: the V^T pre-pass (``forward.fp8_vt``) and the whole kernel at tiny shapes (TMA boxes of 8-bit tiles,
  the consumers' e4m3 MMAs).
* ``gpu``: agreement with ``wgmma_fp8``, ``flash_forward``'s dispatch between the two kernels, replayed calls.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.core import fp8, ptx
from numba_attn.forward import fp8_call, fp8_vt, wgmma_fp8, wgmma_ws, wgmma_ws_fp8
from numba_attn.runtime.device import SIMULATOR, compute_capability, cuda
from test_flash_fp8 import check as _check
from test_flash_wgmma_ws import widths_computed

hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < wgmma_ws_fp8.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma, TMA)")
simulator_only = pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")


check = partial(_check, kernel="wgmma_ws")


# -- always ----------------------------------------------------------------------------------------------------------
def test_configs_and_shared_memory():
    for d_pad in (32, 64, 96, 128):
        assert all(wgmma_ws_fp8.usable(c, d_pad) for c in wgmma_ws_fp8.TUNING_CANDIDATES)
    # Q (128 rows), two stages of K (128 keys) and of V^T (128 head-dim rows), 128 bytes a row; the 16-bit output's
    # staging tiles (128 rows of two 128-byte atom columns); 10 mbarriers; the alignment slack
    assert wgmma_ws.shared_bytes(wgmma_ws.WsConfig(), 128, fp8=True) == 128 * (128 + 2 * 128 + 2 * 128 + 2 * 128) \
        + 8 * 10 + 1024
    # the default: 224-key tiles, persistent, V^T in two atom columns of 128 head-dim rows and 8 rows of ones each
    # (P's row sums from the P V MMA)
    assert wgmma_ws_fp8.DEFAULT_CONFIG == wgmma_ws.WsConfig(block_n=224, persistent=True, fp8_sums=True)
    assert wgmma_ws.shared_bytes(wgmma_ws_fp8.DEFAULT_CONFIG, 128, fp8=True) == 128 * (128 + 2 * 224 + 2 * 272
                                                                                       + 2 * 128) + 8 * 10 + 1024
    assert wgmma_ws.shared_bytes(wgmma_ws_fp8.PREVIOUS_DEFAULT, 128, fp8=True) == 128 * (128 + 2 * 224 + 2 * 256
                                                                                         + 2 * 128) + 8 * 10 + 1024
    assert not wgmma_ws.usable(wgmma_ws_fp8.DEFAULT_CONFIG, 128)  # (an 8-bit form: no 16-bit kernel takes it)
    # 160-key tiles at head dim 64: V^T in two atom columns of 64 rows; the output one atom column
    assert wgmma_ws.shared_bytes(wgmma_ws.WsConfig(block_n=160), 64, fp8=True) == 128 * (128 + 2 * 160 + 2 * 128
                                                                                         + 128) + 8 * 10 + 1024
    assert not wgmma_ws_fp8.usable(wgmma_ws.WsConfig(block_n=176), 128)  # not a whole number of 8-bit k-steps
    assert not wgmma_ws_fp8.usable(wgmma_ws.WsConfig(block_n=48), 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        wgmma_ws._kernel_source(wgmma_ws.WsConfig(block_n=48), 64, True, fp8=True)


def test_unsupported_inputs_are_refused():
    stream = 0 if SIMULATOR else cuda.default_stream()
    lse = cuda.to_device(np.zeros((1, 1, 4), np.float32))
    out = cuda.to_device(np.zeros((1, 1, 4, 40), np.uint16))
    q = cuda.to_device(np.zeros((1, 1, 4, 40), np.uint8))  # 40-byte rows: the TMA cannot step over them
    with pytest.raises(ValueError, match="fp8 wgmma_ws kernel needs"):
        wgmma_ws_fp8.launch(q, q, q, out, lse, False, 0.1, False, stream)
    with pytest.raises(TypeError, match="q: expected float8"):
        wgmma_ws_fp8.launch(out, q, q, out, lse, False, 0.1, False, stream)
    assert not wgmma_ws_fp8.supports(144, cuda.to_device(np.zeros((1, 1, 4, 144), np.uint8)))


# -- simulator -------------------------------------------------------------------------------------------------------
@simulator_only
@pytest.mark.parametrize("seqlen, head_dim", [(70, 48), (140, 16), (20, 128)])
def test_simulated_v_transpose_pre_pass(seqlen, head_dim):
    # V (B, H, N, D) -> V^T (B, H, D, N rounded up to 16): column c of each 16-key group holds key KEY_OF_COLUMN[c],
    # zeros past N; V a strided view (heads and keys swapped in memory); blocks of 128 keys, a partial one
    rng = np.random.default_rng(2)
    batch, heads = 2, 3
    v = rng.integers(1, 255, (batch, seqlen, heads, head_dim)).astype(np.uint8).transpose(0, 2, 1, 3)
    keys = fp8_vt.padded_keys(seqlen)
    vt = np.full((batch, heads, head_dim, keys), 7, np.uint8)
    fp8_vt.transpose(v, vt, 0)
    padded = np.zeros((batch, heads, keys, head_dim), np.uint8)
    padded[:, :, :seqlen] = v
    order = np.array([16 * (c // 16) + fp8.KEY_OF_COLUMN[c % 16] for c in range(keys)])
    np.testing.assert_array_equal(vt, padded[:, :, order].transpose(0, 1, 3, 2))
    with pytest.raises(ValueError, match="vt: expected shape"):
        fp8_vt.transpose(v, vt[..., :16], 0)


@simulator_only
def test_simulated_key_tiles_over_128():
    # 160-key tiles: V^T in two atom columns (128 + 32 keys), the second tile partial
    config = wgmma_ws.WsConfig(block_n=160)
    check(1, 1, 1, 20, 200, 32, False, config=config, seed=5)


@simulator_only
def test_simulated_narrow_tiles():
    # 160-key tiles computed at 64 or 128 keys where a consumer's rows see no further (``mask.narrow_widths``): the
    # diagonal's tiles, causal, in both blocks
    with widths_computed() as (s_widths, pv_widths):
        check(1, 1, 1, 200, 200, 32, True, config=wgmma_ws.WsConfig(block_n=160), seed=6)
    assert s_widths == pv_widths == {64, 128, 160}


@simulator_only
@pytest.mark.parametrize("persistent, causal", [(False, True), (True, False)])
def test_simulated_three_consumers(persistent, causal):
    # 192 rows per block: 200 queries make a second, partial block; 150 keys in 32-key tiles, the last partial
    config = wgmma_ws.WsConfig(block_n=32, stages=2, persistent=persistent, consumers=3, producer_registers=32,
                               consumer_registers=160)
    check(1, 1, 1, 200, 150, 32, causal, config=config, seed=5)


@simulator_only
@pytest.mark.parametrize("persistent", [False, True])
def test_simulated_output_stores(monkeypatch, persistent):
    # the output staged and stored by the TMA where it can write it (rows of 40 elements: 80 bytes), from the
    # registers where it cannot (33: 66-byte rows) -- in 4-byte pairs where the rows keep them aligned (34)
    stores = []
    real = wgmma_ws.output_store
    monkeypatch.setattr(wgmma_ws, "output_store", lambda *a: stores.append(real(*a)[0]) or real(*a))
    config = wgmma_ws.WsConfig(block_n=32, stages=2, persistent=persistent)
    for out_pad in (8, 1, 2):
        check(1, 2, 1, 70, 90, 32, True, config=config, seed=out_pad, out_pad=out_pad)
    assert stores == ["tma", "elements", "pairs"]


@simulator_only
@pytest.mark.parametrize("args, fields", [
    ((1, 1, 1, 20, 200, 32, False), dict(block_n=160)),  # a partial last tile (a narrow one)
    ((1, 2, 1, 70, 90, 32, True), dict(block_n=32, stages=2, persistent=True)),  # GQA, persistent, causal
    ((1, 1, 1, 77, 400, 96, False), dict(block_n=224, persistent=True)),  # the GPU default's tiles, long rows
])
def test_simulated_row_sums_from_the_mma(args, fields, monkeypatch):
    # fp8_sums: P's row sums from the P V MMA (a row of ones under V^T), folded per tile; the model sums the rounded P.
    # A call that asks for the lse runs the softmax's sums (its lse checked against the reference's)
    compiled = []
    kernel_of = wgmma_ws_fp8.flash_ws_fp8_kernel
    monkeypatch.setattr(wgmma_ws_fp8, "flash_ws_fp8_kernel", lambda config, *a, **kw: (
        compiled.append(config.fp8_sums), kernel_of(config, *a, **kw))[1])
    config = wgmma_ws.WsConfig(fp8_sums=True, **fields)
    for write_lse in (False, True):
        error, model_error = check(*args, config=config, seed=5, write_lse=write_lse)
        assert error < 2 * model_error + 1e-3
    assert compiled == [True, False]


@simulator_only
def test_simulated_float16_window_softcap_no_keys():
    check(1, 1, 1, 24, 100, 32, False, out_dtype="float16", window=(20, 3), softcap=4.0)
    check(1, 1, 1, 6, 0, 32, False)  # no keys: wgmma_fp8 writes the zeros and -inf


def _spy(monkeypatch):
    """Record which fp8 kernel each ``flash_forward`` call launches."""
    used = []
    for module, name in ((wgmma_ws_fp8, "ws"), (wgmma_fp8, "plain")):
        original = module.launch

        def spy(*args, _original=original, _name=name, **kwargs):
            used.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    return used


@simulator_only
def test_simulated_flash_forward_backend(monkeypatch):
    used = _spy(monkeypatch)
    rng = np.random.default_rng(3)
    q, k, v = (reference.encode_e4m3(rng.standard_normal(s)) for s in ((1, 2, 10, 32), (1, 1, 40, 32), (1, 1, 40, 32)))
    out = numba_attn.flash_forward(q, k, v, causal=True, input_dtype="float8_e4m3fn", backend="wgmma_ws",
                                   descale_v=np.float32([[2.0]]))
    ref = reference.attention_fp8(q, k, v, None, None, np.float32([[2.0]]), causal=True)
    got = ptx.bf16_bits_to_float32(out).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-2
    numba_attn.flash_forward(q, k, v, input_dtype="float8_e4m3fn")  # the simulator's default: wgmma_fp8
    assert used == ["ws", "plain"]
    with pytest.raises(ValueError, match="backend: float8_e4m3fn inputs run on 'wgmma' or 'wgmma_ws'"):
        numba_attn.flash_forward(q, k, v, input_dtype="float8_e4m3fn", backend="mma")


# -- GPU -------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@hopper
def test_same_as_the_wgmma_fp8_kernel_where_tiles_agree():
    """Both kernels round P per 128-key tile from the same running maxima when no row's maximum moves within a
    block's tiles differently: at the model's tolerance they agree with each other, not just each with the model."""
    a = check(1, 4, 4, 512, 2048, 128, False, seed=21)
    b = _check(1, 4, 4, 512, 2048, 128, False, seed=21, config=wgmma_fp8.DEFAULT_CONFIG)
    assert abs(a[0] - b[0]) < 5e-3


@pytest.mark.gpu
@hopper
def test_default_dispatch(monkeypatch):
    """``flash_forward`` on fp8: the warp-specialised kernel at head dim 128 for rows of >= WS_MIN_KEYS keys,
    ``wgmma_fp8`` for shorter rows, other head dims (64 included: it was faster there) and ``backend="wgmma"``."""
    used = _spy(monkeypatch)
    rng = np.random.default_rng(9)
    n = fp8_call.WS_MIN_KEYS

    def call(head_dim, seqlen_k, **kwargs):
        q, k, v = (reference.encode_e4m3(rng.standard_normal((1, 2, s, head_dim)))
                   for s in (64, seqlen_k, seqlen_k))
        numba_attn.flash_forward(q, k, v, input_dtype="float8_e4m3fn", **kwargs)
        return used.pop()

    assert call(128, n) == "ws" and call(112, n) == "ws" and call(64, n) == "plain"
    assert call(128, n - 1) == "plain" and call(96, n) == "plain" and call(128, 2 * n - 2, causal=True) == "plain"
    assert call(128, n, backend="wgmma") == "plain" and call(64, 64, backend="wgmma_ws") == "ws"


@pytest.mark.gpu
@hopper
def test_replayed_calls_on_new_tensors():
    """Calls after the first replay (``runtime.replay``), each with the tensor maps of its own q, k and V^T scratch:
    a replay with the first call's maps would return the first call's answer."""
    torch = pytest.importorskip("torch")
    from numba_attn.runtime import replay

    replay.clear()
    rng = np.random.default_rng(13)
    used = []
    original = replay.Plan.run
    try:
        replay.Plan.run = lambda self, layouts: used.append(1) or original(self, layouts)
        for call in range(4):
            codes = [reference.encode_e4m3(rng.standard_normal((1, 2, 1100, 128))) for _ in range(3)]
            t = [torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in codes]
            got = numba_attn.flash_forward(*t, causal=True, descale_v=0.5)
            ref = reference.attention_fp8(*codes, None, None, 0.5, causal=True)
            assert np.linalg.norm(got.double().cpu().numpy() - ref) / np.linalg.norm(ref) < 4e-2, call
    finally:
        replay.Plan.run = original
    assert len(used) == 3, "the calls after the first were not replayed"
