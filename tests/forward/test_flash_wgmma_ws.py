"""The warp-specialised Hopper kernel (numba_attn.forward.wgmma_ws) against reference.attention.

* ``gpu`` tests (they skip themselves below sm_90): the real kernel (TMA copies through an mbarrier ring, a producer
  warp, two consumer warpgroups with ``setmaxnreg``, ping-pong through named barriers) on float16 and bfloat16 over
  head dims 64 and 128 (and others that pad), causal or not, lengths 1 .. 4096, Lq != Lk both ways, GQA, lse,
  every tuning candidate, windows and soft-capping, strided views, poisoned outputs; ``flash_forward(backend=
  "wgmma_ws")``, the tensor-map cache and the fallback to ``wgmma``.
* Simulator tests: the same kernel code with the Python twins (mbarriers, TMA boxes, named barriers, wgmma), so the
  pipeline's stages and phases, the ping-pong and the fragment arithmetic run without a GPU (tiny: 384 Python
  threads per block).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest

import numba_attn
from numba_attn.backward import wgmma_ws as backward_ws
from numba_attn.forward import dispatch
from numba_attn.core import warpgroup
from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel
from numba_attn.runtime import tensor_map
from numba_attn.runtime.device import SIMULATOR, compute_capability, cuda, kernel_jit
import reference
from kernel_checks import TOLERANCE, rel_error
from test_flash_mma import POISON, _check

TINY = wgmma_ws.SIMULATOR_CONFIG

hopper = pytest.mark.skipif(SIMULATOR or compute_capability() < wgmma_ws.MIN_COMPUTE_CAPABILITY,
                            reason="needs a GPU of compute capability 9.0 (wgmma, TMA)")


#: ``_check``'s padding of the output's rows for each way of storing it: rows of 16-byte multiples take the TMA
#: store, of 4-byte multiples the pair stores, others element by element
OUT_PAD = {"tma": 8, "pairs": 6, "elements": 5}


@contextlib.contextmanager
def stores_chosen():
    """The launcher's ``(store, map)`` choices made inside, in order."""
    chosen = []
    real = wgmma_ws.output_store
    wgmma_ws.output_store = lambda *args: chosen.append(real(*args)) or chosen[-1]
    try:
        yield chosen
    finally:
        wgmma_ws.output_store = real


def check(*args, config=None, store="tma", **kwargs):
    """``_check`` on ``wgmma_ws.launch``, asserting that the launcher stores the output the way ``store`` says (the
    head dims here are multiples of 8, so the padding of ``OUT_PAD`` decides it)."""
    with stores_chosen() as chosen:
        _check(*args, launch=wgmma_ws.launch, config=config, out_pad=OUT_PAD[store], **kwargs)
    assert all(way == store for way, _ in chosen), chosen


def softmax_under_pv(monkeypatch):
    """Make ``wgmma_ws`` build its kernels with ``softmax_under_pv=True`` (the softmax pinned above the P V wait)."""
    @functools.lru_cache(maxsize=None)
    def build(config, head_dim_pad, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements", probe=None,
              narrow=True):
        source = wgmma_ws_kernel._kernel_source(config, head_dim_pad, bf16, scale_first, variant, store=store,
                                                softmax_under_pv=True, probe=probe, narrow=narrow)
        return kernel_jit((config.threads, 1), wgmma_ws.SIGNATURE)(source)

    monkeypatch.setattr(wgmma_ws, "flash_ws_kernel", build)


# -- always --------------------------------------------------------------------------------------------------------
def test_configs_are_validated_where_made():
    for bad in (dict(block_n=24), dict(block_n=272), dict(stages=0), dict(pingpong=1), dict(persistent=None),
                dict(producer_registers=20),
                dict(consumer_registers=250), dict(producer_registers=56, consumer_registers=240)):
        with pytest.raises(ValueError, match="WsConfig"):
            wgmma_ws.WsConfig(**bad)
    assert wgmma_ws.DEFAULT_CONFIG.block_m == 128 and wgmma_ws.DEFAULT_CONFIG.threads == 384


def test_register_budgets_fit_what_the_launch_holds():
    # 384 threads hold 168 registers each (64512): 24 + 2 x 240 fits exactly, 32 + 2 x 240 (65536, the SM's count)
    # does not -- on an H100 such a block hung in the consumers' setmaxnreg.inc; 512 threads hold 128 each (65536)
    wgmma_ws.WsConfig(producer_registers=24, consumer_registers=240)
    wgmma_ws.WsConfig(consumers=3, producer_registers=32, consumer_registers=160)
    for bad in (dict(producer_registers=32), dict(consumer_registers=248, producer_registers=24),
                dict(consumers=3, producer_registers=40, consumer_registers=160)):
        with pytest.raises(ValueError, match="a block of (384|512) threads holds"):
            wgmma_ws.WsConfig(**bad)
    with pytest.raises(ValueError, match="64512 registers a block of 384 threads holds"):
        backward_ws.WsBackwardConfig(producer_registers=32, consumer_registers=240)
    backward_ws.WsBackwardConfig(producer_registers=40, consumer_registers=232)
    assert all(c.threads * 168 >= 128 * (c.producer_registers + c.consumers * c.consumer_registers)
               for c in backward_ws.GPU_CANDIDATES.values() if c.threads == 384)


def test_candidates_fit_shared_memory():
    assert wgmma_ws.usable(wgmma_ws.DEFAULT_CONFIG, 128) and wgmma_ws.SHARED_LIMIT == 227 * 1024
    for head_dim in range(8, wgmma_ws.MAX_HEAD_DIM + 1, 8):
        d_pad = wgmma_ws.padded_head_dim(head_dim)
        fit = [c for c in wgmma_ws.TUNING_CANDIDATES if wgmma_ws.usable(c, d_pad)]
        assert wgmma_ws.DEFAULT_CONFIG in fit and len(fit) >= 5
        assert all(wgmma_ws.shared_bytes(c, d_pad) <= wgmma_ws.SHARED_LIMIT for c in fit)
    assert not wgmma_ws.usable(wgmma_ws.WsConfig(block_n=128, stages=4), 128)  # 289 KB
    # 128 rows of Q, two stages of 128-key K and V tiles at head dim 128, the barriers, the alignment slack
    assert wgmma_ws.shared_bytes(wgmma_ws.DEFAULT_CONFIG, 128) == 256 * (128 + 4 * 128) + 8 * 10 + 1024


def test_unsupported_inputs_are_refused():
    stream = 0 if SIMULATOR else cuda.default_stream()
    q = cuda.to_device(np.zeros((1, 1, 4, 60), np.float16))  # 120-byte rows: the TMA cannot step over them
    lse = cuda.to_device(np.zeros((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="wgmma_ws kernel needs"):
        wgmma_ws.launch(q, q, q, q, lse, False, 0.1, False, stream)
    big = cuda.to_device(np.zeros((1, 1, 4, 136), np.float16))
    assert not wgmma_ws.supports("float16", 136, big)
    with pytest.raises(ValueError, match="^config: packed sequences"):  # (a schedule: one block per entry)
        wgmma_ws.launch(q, q, q, q, lse, False, 0.1, False, stream, config=wgmma_ws.WsConfig(persistent=True),
                        schedule=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="backend: 'wgmma_ws' takes float16 or bfloat16"):
        numba_attn.flash_forward(np.zeros((4, 16), np.float32), np.zeros((4, 16), np.float32),
                                 np.zeros((4, 16), np.float32), backend="wgmma_ws")
    assert "wgmma_ws" in numba_attn.BACKENDS
    assert dispatch.choose_backend(None, "float16", wgmma_ok=True) == "wgmma"
    assert dispatch.choose_backend(None, "float16", wgmma_ok=True, ws_ok=True) == "wgmma_ws"
    assert dispatch.choose_backend("wgmma", "float16", wgmma_ok=True, ws_ok=True) == "wgmma"
    assert dispatch.choose_backend(None, "float16", wgmma_ok=False, ws_ok=True) == "mma"
    assert all(d % 16 == 0 and d <= wgmma_ws.MAX_HEAD_DIM for d in dispatch.WS_DEFAULT_HEAD_DIMS)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize(
    "dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, config",
    [
        # GQA, Lq < Lk, tail tiles through both stages of the ring (3 tiles), ping-pong
        ("float16", 2, 1, 20, 37, 16, True, TINY),
        # Lq > Lk: rows without keys in consumer 1, a padded head dim, no ping-pong, one stage; persistent: one
        # block walks both heads (the ring's phases and Q's carry over from one head to the next)
        ("bfloat16", 2, 2, 70, 9, 24, True, wgmma_ws.WsConfig(block_n=16, stages=1, pingpong=False,
                                                               persistent=True)),
        # persistent with ping-pong among three consumers: the turns carry over from one head to the next too
        ("float16", 2, 1, 9, 20, 16, False, wgmma_ws.WsConfig(block_n=16, stages=2, persistent=True, consumers=3,
                                                             producer_registers=32, consumer_registers=160)),
    ],
)
def test_simulated_kernel_equals_reference(dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, config,
                                           monkeypatch):
    monkeypatch.setattr(wgmma_ws, "multiprocessor_count", lambda: 1)  # (persistent: one block does every head)
    check(dtype, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, config=config)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_simulated_persistent_snake_rounds(monkeypatch):
    # 3 heads x 2 query blocks = 6 tiles over 4 blocks of threads: round 0 in order, round 1 reversed (blocks 3 and
    # 2 take tiles 4 and 5, blocks 1 and 0 none), causal so that the tiles' lengths differ
    monkeypatch.setattr(wgmma_ws, "multiprocessor_count", lambda: 4)
    check("float16", 1, 3, 3, 130, 48, 16, True, config=wgmma_ws.WsConfig(block_n=16, stages=2, persistent=True))


@contextlib.contextmanager
def widths_computed():
    """The widths (keys) of the ``S = Q K^T`` and ``P V`` MMAs that kernels built inside issue: ``(s, pv)`` sets."""
    s_widths, pv_widths = set(), set()
    real = warpgroup.attention_products

    def recording(block_n, d_pad, bf16, fp8=False, width=None, sum_rows=0):
        q_times_k, p_times_v = real(block_n, d_pad, bf16, fp8, width, sum_rows)
        width = width or block_n

        def q_k(*args):
            s_widths.add(width)
            q_times_k(*args)

        def p_v(*args):
            pv_widths.add(width)
            p_times_v(*args)

        return q_k, p_v

    def clear():  # (kernels built before or inside hold the products they were built with)
        wgmma_ws.flash_ws_kernel.cache_clear()
        wgmma_ws_fp8.flash_ws_fp8_kernel.cache_clear()

    warpgroup.attention_products = recording
    clear()
    try:
        yield s_widths, pv_widths
    finally:
        warpgroup.attention_products = real
        clear()


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, widths", [
    (20, 262, False, {192, 128}),  # the last tile's 70 keys: its first 128
    # block 0: consumer 0's rows see 64 keys of the one tile, consumer 1's 128; block 1: consumer 0's see none of
    # tile 1 (no MMA), consumer 1's 8 (its first 64)
    (200, 200, True, {192, 128, 64}),
    (20, 384, False, {192}),  # keys the tiles divide, no mask: the kernel without narrow tiles (mask.may_narrow)
])
def test_simulated_narrow_tiles(seqlen_q, seqlen_k, causal, widths):
    # 192-key tiles compute at 64, 128 or 192 keys (``mask.narrow_widths``), each where the keys a consumer's rows
    # see end; the output is the reference's, and every width was issued
    with widths_computed() as (s_widths, pv_widths):
        check("float16", 1, 1, 1, seqlen_q, seqlen_k, 16, causal, config=wgmma_ws.WsConfig(block_n=192))
    assert s_widths == widths and pv_widths == widths


@pytest.mark.skipif(not SIMULATOR, reason="the timing probes are timed on a GPU, checked here")
@pytest.mark.parametrize("probe", ["no_softmax", "no_pack"])
def test_simulated_timing_probes_leave_out_their_part(probe):
    # a timing probe (``launch(_probe=...)``) runs the kernel without the softmax or without P's conversion: its
    # output must be wrong, else the probe timed the whole kernel
    with pytest.raises(AssertionError, match="rel_error"):
        _check("float16", 1, 2, 1, 20, 37, 16, False, config=TINY,
               launch=functools.partial(wgmma_ws.launch, _probe=probe), out_pad=OUT_PAD["tma"])


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_simulated_softmax_under_pv(monkeypatch):
    softmax_under_pv(monkeypatch)
    check("float16", 1, 2, 1, 20, 37, 16, True, config=TINY)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_simulated_no_keys():
    check("float16", 1, 1, 1, 3, 0, 16, False, config=TINY, store="elements")  # (no keys: the wgmma kernel's call)


@pytest.mark.skipif(not SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize("store", ["pairs", "elements"])
def test_simulated_register_stores(store):
    # Lq > Lk: consumer 0's rows see no key; the tail block's rows past seqlen_q are not written
    check("bfloat16", 1, 1, 1, 70, 9, 24, True, config=TINY, store=store)


def test_tma_store_clips_rows_and_columns_past_the_output():
    """The simulated TMA store writes the box's part inside the tensor only (a tail block's rows, the padded head
    dim's columns) and only at the wait that covers it."""
    from numba_attn.core.ptx import bulk, tma
    from numba_attn.core.warpgroup import swizzle

    out = np.full((1, 1, 5, 24), 7, np.uint16)
    handle = tma.sim_register_map(tma.SimTensorMap(out, (64, 4, 1, 1), 128))
    smem = np.zeros(64 * 4, np.uint16)
    box = np.arange(256, dtype=np.uint16).reshape(4, 64)  # row r, column c = 64 r + c (before the swizzle)
    smem[swizzle(2 * np.arange(256)) // 2] = box.reshape(-1)
    bulk._sim_tma_store(smem, 0, handle, 0, 2, 0, 0)  # rows 2..5 of a tensor of 5 rows
    assert np.all(out == 7)  # (not before the wait)
    bulk._sim_commit()
    bulk._sim_wait_read0()
    np.testing.assert_array_equal(out[0, 0, 2:], box[:3, :24])
    assert np.all(out[0, 0, :2] == 7)


# -- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 1000, 4096])
def test_lengths_dtypes_head_dims(dtype, head_dim, causal, seqlen):
    check(dtype, 1, 2, 2, seqlen, seqlen, head_dim, causal, seed=seqlen + head_dim)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k",
    [(1, 1000), (63, 65), (65, 63), (1000, 1), (130, 64), (64, 129), (300, 2000), (2000, 300), (70, 0)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_unequal_lengths_and_gqa(seqlen_q, seqlen_k, causal):
    check("float16", 2, 4, 2, seqlen_q, seqlen_k, 64, causal, seed=seqlen_q + seqlen_k)
    check("bfloat16", 1, 6, 1, seqlen_q, seqlen_k, 128, causal, seed=seqlen_q * 3 + seqlen_k)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [8, 16, 40, 72, 80, 96, 112])
def test_padded_head_dims(head_dim):
    check("float16", 1, 2, 1, 300, 300, head_dim, True, seed=head_dim)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("store", ["pairs", "elements"])
@pytest.mark.parametrize("config", [wgmma_ws.DEFAULT_CONFIG, wgmma_ws.WsConfig(persistent=True)])
def test_register_stores(store, config):
    check("bfloat16", 1, 3, 1, 333, 290, 128, True, config=config, store=store, seed=5)
    check("float16", 2, 2, 2, 1000, 1000, 80, False, config=config, store=store, seed=6)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", wgmma_ws.TUNING_CANDIDATES + (wgmma_ws.WsConfig(block_n=256, stages=2),
                                                                  wgmma_ws.WsConfig(block_n=64, stages=1),
                                                                  wgmma_ws.WsConfig(producer_registers=40,
                                                                                    consumer_registers=232)))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tile_configs_many_tiles(config, head_dim):
    if wgmma_ws.shared_bytes(config, head_dim) > wgmma_ws.SHARED_LIMIT:
        pytest.skip("tiles do not fit")
    check("bfloat16", 1, 2, 1, 1100, 3001, head_dim, True, config=config, seed=11)
    check("float16", 2, 2, 2, 300, 257, head_dim, False, config=config, seed=12)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", [c for c in wgmma_ws.TUNING_CANDIDATES if c.consumers == 3 or c.persistent])
def test_many_queued_calls(config):
    """200 calls queued back to back, each output equal to the first and the first to the reference: with three
    consumers the epilogue's named barrier once shared its id with the third ping-pong barrier, and an illegal
    instruction came only under such a load (H100, 2026-11-27: 300 queued calls at B4 H48 N1024 causal; single
    calls passed)."""
    rng = np.random.default_rng(13)
    shape = (4, 48, 1024, 64)
    host = [rng.standard_normal(shape).astype(np.float16) for _ in range(3)]
    q, k, v = (cuda.to_device(x.view(np.uint16)) for x in host)
    out = cuda.to_device(np.full(shape, POISON["float16"], np.uint16))
    lse = cuda.to_device(np.zeros(shape[:3], np.float32))
    stream = cuda.default_stream()
    wgmma_ws.launch(q, k, v, out, lse, False, 0.125, True, stream, config=config, dtype="float16")
    first = out.copy_to_host().view(np.float16)
    for _ in range(200):
        wgmma_ws.launch(q, k, v, out, lse, False, 0.125, True, stream, config=config, dtype="float16")
    cuda.synchronize()
    assert np.array_equal(out.copy_to_host().view(np.float16), first)
    for b, h in ((0, 0), (3, 47)):
        ref = reference.attention(*(x[b:b + 1, h:h + 1].astype(np.float64) for x in host), causal=True,
                                  sm_scale=0.125)
        assert rel_error(first[b:b + 1, h:h + 1], ref) < TOLERANCE["float16"]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("sm_scale", [0.0, -0.4, 3.0])
def test_scales(sm_scale):
    check("float16", 1, 2, 1, 200, 230, 64, True, sm_scale=sm_scale, seed=7)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("layout", ["blhd", "pad8"])
def test_strided_views(layout):
    check("float16", 2, 4, 2, 150, 170, 64, True, layout, seed=3)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", [wgmma_ws.DEFAULT_CONFIG, wgmma_ws.WsConfig(persistent=True)])
def test_softmax_under_pv(monkeypatch, config):
    softmax_under_pv(monkeypatch)
    check("bfloat16", 1, 2, 1, 1100, 3001, 128, True, config=config, seed=5)
    check("float16", 2, 2, 2, 300, 257, 64, False, config=config, seed=6)
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    ref = numba_attn.flash_forward(q, k, v, backend="wgmma", window=(100, 0), causal=True, softcap=20.0)
    lse = torch.empty(1, 2, 700, device="cuda", dtype=torch.float32)
    wgmma_ws.launch(*(cuda.as_cuda_array(x.view(torch.int16)) for x in (q, k, v, out)), cuda.as_cuda_array(lse),
                    False, 128 ** -0.5, True, cuda.default_stream(), config=config, dtype="float16",
                    window=(100, 0), softcap=20.0)
    torch.cuda.synchronize()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


def test_warp_uniform_gives_lane_zeros_value():
    from numba_attn.core.ptx import warp_uniform

    @kernel_jit()
    def kernel(out):
        tid = cuda.threadIdx.x
        out[tid] = warp_uniform(tid // 32 * 7 - 3)  # (the warpgroup index's kind of value: one per warp)

    out = cuda.to_device(np.full(96, -99, np.int32))
    kernel[1, 96](out)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(96) // 32 * 7 - 3)


def test_windowed_calls_run_the_persistent_form():
    default = wgmma_ws.default_config()
    persistent = dataclasses.replace(default, persistent=True)
    assert wgmma_ws.for_window(default, 128, None) is default
    assert wgmma_ws.for_window(default, 128, (None, 0)) is default  # (no left side: rows as long as dense ones)
    assert wgmma_ws.for_window(None, 128, (None, 4)) is None
    deep = wgmma_ws.WsConfig(block_n=128, stages=3)  # (tuned on dense calls; with staging tiles it would not fit)
    for config in (None, default, deep):
        assert wgmma_ws.for_window(config, 128, (4096, 0)) == persistent
        assert wgmma_ws.for_window(config, 64, (64, 64)) == persistent


@pytest.mark.gpu
@hopper
def test_window_and_softcap_match_the_wgmma_kernel(monkeypatch):
    torch = pytest.importorskip("torch")
    launched = []
    real_launch = wgmma_ws.launch

    def launch(*args, config=None, **kwargs):
        launched.append(config)
        return real_launch(*args, config=config, **kwargs)
    monkeypatch.setattr(wgmma_ws, "launch", launch)
    q, k, v = (torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    for options in (dict(window=(100, 0), causal=True), dict(window=(64, 32)), dict(softcap=20.0, causal=True)):
        ref = numba_attn.flash_forward(q, k, v, backend="wgmma", **options)
        launched.clear()
        got = numba_attn.flash_forward(q, k, v, backend="wgmma_ws", **options)
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3, options
        if "window" in options:  # (the others run the tuned entry)
            assert launched and launched[-1].persistent, (options, launched)


@pytest.mark.gpu
@hopper
def test_flash_forward_backend_maps_cache_and_fallback(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("NUMBA_ATTN_AUTOTUNE", "0")
    q = torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ref, ref_lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True, backend="wgmma")
    maps = tensor_map.maps_for()
    got, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True, backend="wgmma_ws")
    uploads = maps.uploads
    again = numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma_ws", out=got)
    assert maps.uploads == uploads  # the same tensors, the same output: no new map
    fresh = torch.empty_like(got)
    numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma_ws", out=fresh)
    assert maps.uploads == uploads + 1  # a new output: its map (the TMA store's) only
    for x in (got, again, fresh):
        assert ((x.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=0)
    # the driver refusing a map: the call still runs, on wgmma
    monkeypatch.setattr(tensor_map, "encode_tiled", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    q2 = q.clone()
    out = numba_attn.flash_forward(q2, k, v, causal=True, backend="wgmma_ws")
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("persistent", [False, True])
def test_tma_store_into_strided_outputs(monkeypatch, persistent):
    """``out=`` views the TMA can write (rows of a (B, N, H, D) buffer; rows padded to 16-byte multiples) take the
    TMA store; the padding and the other rows' memory stay as they were."""
    torch = pytest.importorskip("torch")
    config = wgmma_ws.WsConfig(persistent=persistent)
    tuned = dispatch._tuned_config
    monkeypatch.setattr(dispatch, "_tuned_config",
                        lambda tuner, *a, **k: config if tuner is dispatch.FLASH_WS_TUNER else tuned(tuner, *a, **k))
    q = torch.randn(2, 4, 333, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ref = numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma")
    poison = -7.0
    blhd = torch.full((2, 333, 4, 128), poison, device="cuda", dtype=torch.bfloat16)
    padded = torch.full((2, 4, 333, 136), poison, device="cuda", dtype=torch.bfloat16)
    for memory, out in ((blhd, blhd.permute(0, 2, 1, 3)), (padded, padded[..., :128])):
        with stores_chosen() as chosen:
            got = numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma_ws", out=out)
        assert chosen and chosen[-1][0] == "tma", chosen
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        if memory is padded:
            assert bool((padded[..., 128:] == poison).all()), "wrote past headdim"


@pytest.mark.gpu
@hopper
def test_cuda_graph_capture():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 4, 500, 128, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ref = numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma")
    q2 = q.clone()  # new tensors: their maps are written inside the capture
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        numba_attn.flash_forward(q2, k, v, causal=True, backend="wgmma_ws")  # warm-up: compiles
        torch.cuda.synchronize()
        q3 = q.clone()
        with torch.cuda.graph(graph, stream=stream):
            out = numba_attn.flash_forward(q3, k, v, causal=True, backend="wgmma_ws")
    graph.replay()
    torch.cuda.synchronize()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


@pytest.mark.gpu
@hopper
def test_default_dispatch_by_head_dim(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("NUMBA_ATTN_AUTOTUNE", "0")
    calls = []
    for module, name in ((wgmma_ws, "wgmma_ws"), (dispatch._flash_wgmma, "wgmma")):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                                        _real(*a, **kw))[1])
    for head_dim in (64, 128, 120, 48):
        pad = wgmma_ws.padded_head_dim(head_dim)
        min_seqlen_k = dispatch.WS_MIN_SEQLEN_K_AT.get(pad)
        edges = ((min_seqlen_k - 2, min_seqlen_k) if min_seqlen_k  # keys counted, causal or not
                 else (2 * dispatch.WS_MIN_KEYS - 2, 2 * dispatch.WS_MIN_KEYS))  # causal: seqlen / 2 on average
        for seqlen in (300,) + edges:
            q = torch.randn(1, 2, seqlen, head_dim, device="cuda", dtype=torch.float16)
            numba_attn.flash_forward(q, q, q, causal=True)
            ws = pad in dispatch.WS_DEFAULT_HEAD_DIMS and seqlen >= (min_seqlen_k or 2 * dispatch.WS_MIN_KEYS)
            assert calls[-1] == ("wgmma_ws" if ws else "wgmma"), (head_dim, seqlen, calls)
