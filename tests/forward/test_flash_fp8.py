"""The float8 e4m3 forward (numba_attn.forward.wgmma_fp8 and, where both kernels take the same checks, the
warp-specialised wgmma_ws_fp8; ``flash_forward`` on float8 inputs) against reference.attention_fp8 (the float64 reference of the dequantised inputs) and reference.flash_fp8_model (the same
with the kernel's rounding of P to e4m3 modelled).

Error bounds: the kernel rounds P (times 2^8: ``core.fp8.P_EXPONENT``) to e4m3 (3 mantissa bits) for the P V
product, as FlashAttention-3 does; against
the float64 reference that costs about 2.5e-2 relative (L2) for unit-variance scores spread over many keys and 5e-3
for peaked ones (``reference.flash_fp8_model`` reproduces it, the GPU tests print both). The kernel must match the
model to within its 16-bit output's rounding (``MODEL_TOLERANCE``) and the reference to within the model's error plus
that (``check``). The lse: within ``lse_bound`` (the e4m3 MMAs' accumulation keeps about 14 bits; measured lse errors
1.4e-3..3.1e-3 at scores of standard deviation ~2, D 64 / 128). torch has no fp8 attention to compare with.

* Always: the e4m3 codec against the reference's table (and torch's), the P packing and the key order, argument
  checks.
* Simulator: the V transposer and the whole kernel at tiny shapes (the warpgroup twins decode the 8-bit operands
  through the documented layouts).
* ``gpu``: both kernels (``KERNELS``) over head dims, lengths, GQA, descale kinds, tile configurations, window and
  softcap; torch tensors. (``test_flash_fp8_ws``: what only the warp-specialised kernel has.)
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.core import fp8, ptx
from numba_attn.core.swizzled_tiles import swizzled_tile_loader
from numba_attn.forward import wgmma_fp8, wgmma_ws, wgmma_ws_fp8
from numba_attn.runtime.device import SIMULATOR, compute_capability, cuda

MODEL_TOLERANCE = {"bfloat16": 8e-3, "float16": 5e-3}  # kernel vs model: the 16-bit output, float32 sums, ex2.approx
#: the e4m3 tensor cores add products keeping about 14 bits (measured on the H100; DeepSeek-V3 reports the same of the
#: H800): a score's error follows the size of its terms, so the lse bound per row is 1e-4 + this times sm_scale
#: max_j sum_d |q_id k_jd|
LSE_ACCUMULATION = 2.0 ** -11


def lse_bound(qf, kf, sm_scale):
    """Per-row lse tolerance of the fp8 kernel (dequantised (batch, heads, seqlen, d) inputs, grouped heads)."""
    group = qf.shape[1] // kf.shape[1]
    terms = np.zeros(qf.shape[:3])
    for b in range(qf.shape[0]):
        for h in range(qf.shape[1]):
            if kf.shape[2]:
                terms[b, h] = (np.abs(qf[b, h]) @ np.abs(kf[b, h // group]).T).max(axis=1)
    return 1e-4 + LSE_ACCUMULATION * abs(sm_scale) * terms
POISON = 0x7FC0  # a NaN in bfloat16 and float16 alike (0x7FC0 as float16 is NaN too)

#: the fp8 kernels the shared checks run: their launch, default configuration (of a window and softcap) and the tile
#: configurations the GPU tests try
KERNELS = {
    "wgmma": (wgmma_fp8.launch, wgmma_fp8.default_config,
              wgmma_fp8.TUNING_CANDIDATES + (wgmma_fp8.Fp8Config(32, 3),)),
    "wgmma_ws": (wgmma_ws_fp8.launch, lambda window, softcap: wgmma_ws_fp8.default_config(),
                 wgmma_ws_fp8.TUNING_CANDIDATES + (wgmma_ws.WsConfig(persistent=True),)),
}

hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < wgmma_fp8.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma)")
simulator_only = pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")


def _to_float(bits, out_dtype):
    if out_dtype == "float16":
        return np.ascontiguousarray(bits).view(np.float16).astype(np.float64)
    return ptx.bf16_bits_to_float32(bits).astype(np.float64)


def check(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, *, descale=None, out_dtype="bfloat16",
          config=None, seed=0, scale=1.5, sm_scale=None, window=None, softcap=None, kernel="wgmma", out_pad=8,
          write_lse=None):
    """Launch one of ``KERNELS`` on e4m3 inputs with a poisoned output ``out_pad`` columns wider than headdim;
    compare with the model and the reference. ``config``: the kernel's (None: its default). ``write_lse``: True, the
    call writes the lse (checked too); False, it does not (and leaves the lse array alone); None, True -- and on a GPU
    False as well where the configuration takes P's row sums from the P V MMA (``WsConfig.fp8_sums``), whose
    lse-less calls sum the rounded P (the model's ``rounded_sums``) while calls asking for the lse keep the softmax's
    sums. Returns the (last) call's error against the reference and the model's."""
    rng = np.random.default_rng(seed)
    q = reference.encode_e4m3(rng.standard_normal((batch, heads, seqlen_q, head_dim)) * scale)
    k = reference.encode_e4m3(rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)) * scale)
    v = reference.encode_e4m3(rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)))
    launch, default_config, _ = KERNELS[kernel]
    config = config or default_config(window, softcap)
    sums = getattr(config, "fp8_sums", False)
    modes = [write_lse] if write_lse is not None else [True] + ([False] if sums and not SIMULATOR else [])
    sm = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    factors = descale or (None, None, None)
    ref, ref_lse = reference.attention_fp8(q, k, v, *factors, causal=causal, sm_scale=sm, return_lse=True,
                                           window=window, softcap=softcap)
    qf, kf, vf = reference.dequantize(q, k, v, *factors)
    norm = max(np.linalg.norm(ref), 1e-30)
    empty = np.isneginf(ref_lse)
    for lse_too in modes:
        got, lse_host = _launch(launch, q, k, v, head_dim, out_pad, descale, config, sm, causal, out_dtype, window,
                                softcap, lse_too)
        model = reference.flash_fp8_model(qf, kf, vf, causal=causal, sm_scale=sm, block_n=config.block_n,
                                          window=window, softcap=softcap, rounded_sums=sums and not lse_too,
                                          p_exponent=fp8.P_EXPONENT)
        model_error = np.linalg.norm(model - ref) / norm
        error = np.linalg.norm(got - ref) / norm
        assert np.linalg.norm(got - model) / norm < MODEL_TOLERANCE[out_dtype], (error, model_error, lse_too)
        assert error < model_error + MODEL_TOLERANCE[out_dtype]
        assert np.all(got[empty] == 0.0), "rows without keys: 0"
        if not lse_too:
            assert np.all(np.isnan(lse_host)), "an lse written where none was asked for"
            continue
        assert np.all(np.isneginf(lse_host[empty])), "rows without keys: an lse of -inf"
        assert np.all(np.abs(lse_host[~empty] - ref_lse[~empty]) <= lse_bound(qf, kf, sm)[~empty])
    return error, model_error


def _launch(launch, q, k, v, head_dim, out_pad, descale, config, sm, causal, out_dtype, window, softcap, write_lse):
    """One launch into a poisoned output (checked for writes past headdim) and a NaN lse: ``(out, lse)`` on the
    host, the output as float64."""
    batch, heads, seqlen_q = q.shape[:3]
    out_mem = cuda.to_device(np.full((batch, heads, seqlen_q, head_dim + out_pad), POISON, np.uint16))
    out = out_mem[:, :, :, :head_dim]
    lse = cuda.to_device(np.full((batch, heads, seqlen_q), np.nan, np.float32))
    views = None
    if descale is not None:
        views = tuple(float(x) if np.ndim(x) == 0 else cuda.to_device(np.asarray(x, np.float32)) for x in descale)
        if not all(isinstance(x, float) for x in views):
            views = tuple(cuda.to_device(np.full((batch, 1), x, np.float32)) if isinstance(x, float) else x
                          for x in views)
    stream = 0 if SIMULATOR else cuda.default_stream()
    launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, write_lse, sm, causal, stream,
           descale=views, config=config, out_dtype=out_dtype, window=window, softcap=softcap)
    got_mem = out_mem.copy_to_host()
    assert np.all(got_mem[..., head_dim:] == POISON), "wrote past headdim"
    return _to_float(got_mem[..., :head_dim], out_dtype), lse.copy_to_host()


# -- always ----------------------------------------------------------------------------------------------------------
def test_e4m3_codec_matches_the_reference_table():
    np.testing.assert_array_equal(np.nan_to_num(ptx.E4M3_VALUES.astype(np.float64), nan=1e9),
                                  np.nan_to_num(reference.fp8.E4M3, nan=1e9))
    x = np.random.default_rng(0).standard_normal(20000) * np.exp(np.random.default_rng(1).uniform(-12, 7, 20000))
    x = np.concatenate([x, [0.0, -0.0, 448.0, 464.0, 465.0, -1e9, np.inf, np.nan],
                        (reference.fp8.E4M3[1:127] + reference.fp8.E4M3[:126]) / 2])  # ties go to even codes
    np.testing.assert_array_equal(ptx.float32_to_e4m3_bits(x.astype(np.float32)), reference.encode_e4m3(x))
    np.testing.assert_array_equal(reference.decode_e4m3(reference.encode_e4m3(reference.fp8.E4M3[:127])),
                                  reference.fp8.E4M3[:127])


def test_e4m3_codec_matches_torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(np.nan_to_num(table, nan=1e9), np.nan_to_num(reference.fp8.E4M3, nan=1e9))
    x = (np.random.default_rng(2).standard_normal(20000) * 50).astype(np.float32)
    theirs = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(reference.encode_e4m3(x), theirs)


def test_key_order():
    # a permutation of each 16-key group, pairing the C fragment's keys (2t, 2t + 1, 8 + 2t, 9 + 2t) per lane
    assert sorted(fp8.KEY_OF_COLUMN) == list(range(16))
    for t in range(4):
        assert fp8.KEY_OF_COLUMN[4 * t: 4 * t + 4] == (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)


@simulator_only  # (calls the device function from Python: only its simulator form can be)
def test_probability_packing():
    # one lane's packing: its A bytes for k-column c must hold the score of key 16 (c // 16) + KEY_OF_COLUMN[c % 16]
    # (row g in words 0 and 2 of a k-step, row g + 8 in words 1 and 3; k-step of 32 keys)
    values = ptx.E4M3_VALUES[8:72]  # 64 distinct exact values, keys 0..31 of rows g and g + 8
    for t in range(4):
        s = np.zeros((1, 4, 4), np.float32)
        for nb in range(4):
            for e in range(4):
                s[0, nb, e] = values[32 * (e // 2) + 8 * nb + 2 * t + e % 2]
        p = np.zeros(4, np.uint32)
        fp8.probabilities(1)(s, p)
        for word in range(4):
            row, half = word % 2, word // 2
            for byte in range(4):
                column = 16 * half + 4 * t + byte  # the A fragment's k-column (CUTLASS's ALayout_64x32)
                key = 16 * half + fp8.KEY_OF_COLUMN[column % 16]
                code = (int(p[word]) >> (8 * byte)) & 0xFF
                assert ptx.E4M3_VALUES[code] == values[32 * row + key]


def test_configs_and_shared_memory():
    for bad in (dict(block_n=48), dict(block_n=256), dict(block_n=0), dict(blocks_per_sm=0), dict(v_transpose="x")):
        with pytest.raises(ValueError, match="Fp8Config"):
            wgmma_fp8.Fp8Config(**bad)
    for config in wgmma_fp8.TUNING_CANDIDATES:
        for d in (32, 64, 96, 128):
            # two blocks per SM on the H100 (228 KB, 1 KB reserved per block)
            assert 2 * (wgmma_fp8.shared_bytes(config, d) + 1024) <= 228 * 1024
    assert wgmma_fp8.padded_head_dim(48) == 64 and wgmma_fp8.padded_head_dim(128) == 128


def _codes(*shape, seed=0):
    return reference.encode_e4m3(np.random.default_rng(seed).standard_normal(shape))


@pytest.mark.parametrize("kwargs, name", [
    (dict(descale_q=np.ones((2, 3), np.float32)), "descale_q"),  # neither (batch, heads) nor (batch, kv_heads)
    (dict(descale_k=np.ones((1, 1), np.float64) * 2, descale_v=np.ones((1, 4), np.float64)), "descale_v"),
    (dict(descale_v=-1.0), "descale_v"),
    (dict(descale_q=float("nan")), "descale_q"),
    (dict(descale_k=np.zeros((1, 2), np.float32)), "descale_k"),
    (dict(descale_q=True), "descale_q"),
    (dict(out_dtype="float32"), "out_dtype"),
    (dict(backend="mma"), "backend"),
    (dict(input_dtype="int8"), "input_dtype"),
])
def test_bad_fp8_arguments_name_the_argument(kwargs, name):
    q, k = _codes(1, 4, 8, 32), _codes(1, 2, 8, 32, seed=1)
    kwargs = dict(kwargs)
    kwargs.setdefault("input_dtype", "float8_e4m3fn")
    with pytest.raises(ValueError, match=f"^{name}"):
        numba_attn.flash_forward(q, k, k, **kwargs)


def test_fp8_mixed_with_16_bit_or_options_without_fp8_are_refused():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    q = torch.from_numpy(_codes(1, 2, 8, 32)).view(torch.float8_e4m3fn)
    half = torch.zeros(1, 2, 8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="^k"):
        numba_attn.flash_forward(q, half, q)
    with pytest.raises(ValueError, match="^q"):
        numba_attn.flash_forward(half, q, q)
    with pytest.raises(ValueError, match="^descale_q"):
        numba_attn.flash_forward(half, half, half, descale_q=0.5)
    with pytest.raises(ValueError, match="^out_dtype"):
        numba_attn.flash_forward(half, half, half, out_dtype="float16")
    with pytest.raises(ValueError, match="^q"):  # headdim not a multiple of 16
        numba_attn.flash_forward(q[..., :24], q[..., :24], q[..., :24])
    if not SIMULATOR and compute_capability() < wgmma_fp8.MIN_COMPUTE_CAPABILITY:
        with pytest.raises(ValueError, match="^q: float8_e4m3fn inputs need a GPU of compute capability 9.0"):
            numba_attn.flash_forward(q.cuda(), q.cuda(), q.cuda())


# -- simulator: the real kernel code on tiny tiles -------------------------------------------------------------------
@simulator_only
@pytest.mark.parametrize("block_n, head_dim, source", [(32, 32, "staging"), (64, 48, "staging"),
                                                       (32, 32, "swizzled"), (64, 48, "swizzled")])
def test_simulated_v_transposer(block_n, head_dim, source):
    # V tile (staging layout, or the hardware's 128-byte swizzle as the TMA writes it) -> V^T: row d, k-column c
    # (swizzled) holds V[16 (c // 16) + KEY_OF_COLUMN[c % 16], d]
    d_pad = wgmma_fp8.padded_head_dim(head_dim)
    keys = block_n - 5  # a tail: rows past the keys are zeros
    v = np.random.default_rng(3).integers(1, 120, (keys, head_dim)).astype(np.uint8)
    if source == "staging":
        load = fp8.staging_loader(block_n, d_pad, 128)
        transpose = fp8.v_transposer(block_n, d_pad, 128)
    else:
        load = swizzled_tile_loader(block_n, d_pad, 128, 1)
        transpose = fp8.v_transposer_swizzled(block_n, d_pad, 128)
    words = 64 * (block_n + d_pad)

    @cuda.jit
    def kernel(v, dump):
        smem = cuda.shared.array(words, np.uint16)
        tid = cuda.threadIdx.x
        load(v, smem, 0, tid, 0, keys, head_dim)
        cuda.syncthreads()
        transpose(smem, 0, 64 * block_n, tid)
        cuda.syncthreads()
        for i in range(tid, words, 128):
            dump[i] = smem[i]

    dump = np.zeros(words, np.uint16)
    kernel[1, 128](v, dump)
    vt = dump[64 * block_n:].view(np.uint8)
    padded = np.zeros((block_n, d_pad), np.uint8)
    padded[:keys, :head_dim] = v
    for d in range(d_pad):
        for c in range(block_n):
            at = wgmma_fp8_swizzle(128 * d + c)
            assert vt[at] == padded[16 * (c // 16) + fp8.KEY_OF_COLUMN[c % 16], d], (d, c)


def wgmma_fp8_swizzle(offset):
    from numba_attn.core import warpgroup

    return int(warpgroup.swizzle(offset))


_PER_HEAD = (np.float32([[0.5, 2.0]]), np.float32([[0.7]]), np.float32([[1.5]]))


@simulator_only
@pytest.mark.parametrize(
    "kernel, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, descale",
    [
        # GQA, Lq < Lk, a tail tile, both stages of K / V^T (wgmma_ws: the two-stage rings wrapped once); per-head
        # descales in both shapes
        ("wgmma", 2, 1, 20, 40, 32, True, _PER_HEAD),
        ("wgmma_ws", 2, 1, 20, 70, 32, True, _PER_HEAD),
        # Lq > Lk: rows that see no key; head dim padded (48 -> 64); per-tensor descales
        ("wgmma", 1, 1, 40, 9, 48, True, (0.5, 0.25, 3.0)),
        ("wgmma_ws", 1, 1, 40, 9, 48, True, (0.5, 0.25, 3.0)),
    ],
)
def test_simulated_kernel(kernel, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, descale):
    check(1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, descale=descale, kernel=kernel)


@simulator_only
def test_simulated_float16_window_softcap_negative_scale():
    # three tiles: the stages of K, staged V and V^T reused (the window skips the first tile); V transposed with
    # ldmatrix from the hardware's swizzle
    check(1, 1, 1, 24, 100, 32, False, out_dtype="float16", window=(20, 3), softcap=4.0,
          config=wgmma_fp8.Fp8Config(32, 1, "ldmatrix"))
    check(1, 1, 1, 5, 33, 32, True, sm_scale=-0.3)


@simulator_only
def test_simulated_flash_forward_torch_and_numpy():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    q, k, v = _codes(1, 1, 10, 32), _codes(1, 1, 40, 32, seed=1), _codes(1, 1, 40, 32, seed=2)
    tq, tk, tv = (torch.from_numpy(x).view(torch.float8_e4m3fn) for x in (q, k, v))
    out, lse = numba_attn.flash_forward(tq, tk, tv, causal=True, return_lse=True, descale_q=torch.tensor([0.5]),
                                        descale_k=2.0, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == (1, 1, 10, 32) and lse.dtype == torch.float32
    ref, ref_lse = reference.attention_fp8(q, k, v, 0.5, 2.0, causal=True, return_lse=True)
    assert np.linalg.norm(out.double().numpy() - ref) / np.linalg.norm(ref) < 4e-2
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-4)
    empty = numba_attn.flash_forward(q, k[:, :, :0], v[:, :, :0], input_dtype="float8_e4m3fn")  # no keys: zeros
    assert empty.dtype == np.uint16 and np.all(ptx.bf16_bits_to_float32(empty) == 0.0)


# -- GPU -------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 96, 112, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(kernel, head_dim, causal):
    check(2, 4, 2, 300, 300, head_dim, causal, seed=head_dim, kernel=kernel)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seqlen_q, seqlen_k",
                         [(1, 1), (1, 1000), (63, 65), (65, 63), (1000, 1), (1000, 1000), (130, 64), (70, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(kernel, seqlen_q, seqlen_k, causal):
    check(1, 2, 1, seqlen_q, seqlen_k, 64, causal, seed=seqlen_q + seqlen_k, kernel=kernel)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel, config", [(kernel, config) for kernel, (_, _, configs) in KERNELS.items()
                                            for config in configs])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tile_configs_descales_and_outputs(kernel, config, head_dim):
    rng = np.random.default_rng(4)
    per_head = (rng.uniform(0.5, 2, (2, 4)).astype(np.float32), rng.uniform(0.5, 2, (2, 2)).astype(np.float32),
                rng.uniform(0.5, 2, (2, 2)).astype(np.float32))
    check(2, 4, 2, 1100, 3001, head_dim, True, config=config, descale=per_head, seed=11, kernel=kernel)
    check(1, 2, 2, 300, 257, head_dim, False, config=config, descale=(0.3, 2.0, 1.7), out_dtype="float16", seed=12,
          kernel=kernel)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", KERNELS)
def test_window_softcap_peaky_and_negative_scale(kernel):
    check(1, 2, 1, 700, 900, 128, True, window=(200, None), softcap=20.0, seed=5, kernel=kernel)
    check(1, 2, 2, 500, 500, 64, False, scale=4.0, sm_scale=0.3, seed=6, kernel=kernel)  # peaked rows: P near 1
    check(1, 2, 1, 200, 230, 64, True, sm_scale=-0.4, seed=7, kernel=kernel)


@pytest.mark.gpu
@hopper
def test_flash_forward_torch_float8(capsys):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q, k, v = (reference.encode_e4m3(rng.standard_normal(s)) for s in ((2, 8, 1000, 128), (2, 2, 1200, 128),
                                                                           (2, 2, 1200, 128)))
    tq, tk, tv = (torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in (q, k, v))
    dq = torch.rand(2, 2, device="cuda") + 0.5  # FlashAttention-3's (batch, kv_heads)
    dk, dv = torch.rand(2, 2, device="cuda") + 0.5, torch.tensor(0.8, device="cuda")  # (a 0-d device tensor)
    out, lse = numba_attn.flash_forward(tq, tk, tv, causal=True, return_lse=True, descale_q=dq, descale_k=dk,
                                        descale_v=dv)
    assert out.dtype == torch.bfloat16 and out.is_cuda
    ref, ref_lse = reference.attention_fp8(q, k, v, dq.cpu().numpy(), dk.cpu().numpy(), 0.8, causal=True,
                                           return_lse=True)
    qf, kf, vf = reference.dequantize(q, k, v, dq.cpu().numpy(), dk.cpu().numpy(), 0.8)
    model = reference.flash_fp8_model(qf, kf, vf, causal=True)
    err = np.linalg.norm(out.double().cpu().numpy() - ref) / np.linalg.norm(ref)
    model_err = np.linalg.norm(model - ref) / np.linalg.norm(ref)
    with capsys.disabled():
        print(f"\nfp8 forward vs float64 reference: {err:.2e} (P in e4m3, modelled: {model_err:.2e})")
    assert err < model_err + MODEL_TOLERANCE["bfloat16"]
    assert np.all(np.abs(lse.cpu().numpy() - ref_lse) <= lse_bound(qf, kf, 1 / math.sqrt(128)))
    strided = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).cuda().view(torch.float8_e4m3fn)
    again = numba_attn.flash_forward(strided.transpose(1, 2), tk, tv, causal=True, descale_q=dq, descale_k=dk,
                                     descale_v=dv)
    assert torch.equal(again, out)  # (batch, seqlen, heads, headdim) views: same bits
