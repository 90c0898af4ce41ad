"""Every public function's repeated calls replay (``runtime.replay``) on a GPU, against ``reference``: the variants
``test_replay.py`` does not cover (backends, window / softcap, deterministic, the non-causal linear layer and the
linear backwards, fp8 with descale factors copied from the host) and varlen calls with host ``cu_seqlens``, whose
plans hold the offsets' values (a changed offset must never replay a stale schedule).

Each call takes fresh tensors, with the caching allocator's free blocks poisoned first (a replay that launched
nothing would return stale memory); ``replays`` counts ``Plan.run`` calls.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_replay import _poison_free_blocks, _rel, replays  # noqa: F401  (replays: a fixture)

TOLERANCE = {"float16": 3e-3, "float32": 2e-5, "bfloat16": 2e-2}


def _tensors(torch, rng, shapes, dtype, scale=1.0):
    """``(torch tensors, their float64 values as the kernels see them)``."""
    tensors = [torch.tensor(rng.standard_normal(s).astype(np.float32) * scale, device="cuda",
                            dtype=getattr(torch, dtype)) for s in shapes]
    return tensors, [t.cpu().double().numpy() for t in tensors]


def _forward(torch, rng, dtype, **options):
    t, x = _tensors(torch, rng, [(1, 4, 150, 64), (1, 2, 170, 64), (1, 2, 170, 64)], dtype)
    import numba_attn
    import reference

    reference_options = {name: value for name, value in options.items() if name not in ("backend", "allow_tf32")}
    return numba_attn.flash_forward(*t, **options), reference.attention(*x, **reference_options)


def _backward(torch, rng, dtype, **options):
    import numba_attn
    import reference

    t, x = _tensors(torch, rng, [(1, 4, 150, 64), (1, 2, 170, 64), (1, 2, 170, 64), (1, 4, 150, 64)], dtype)
    out, lse = reference.attention(*x[:3], return_lse=True, **options)
    out_t = torch.tensor(out, device="cuda", dtype=t[0].dtype)
    lse_t = torch.tensor(lse, device="cuda", dtype=torch.float32)
    got = numba_attn.flash_backward(t[3], *t[:3], out_t, lse_t, deterministic=True, **options)
    return got, reference.attention_backward(x[3], *x[:3], **options)


def _linear(torch, rng, dtype, function, causal=False):
    import numba_attn
    import reference

    shapes = [(1, 2, 256, 64)] * (4 if function.endswith("backward") else 3)
    t, x = _tensors(torch, rng, shapes, dtype, 0.3)
    if function == "linear_attention":
        return numba_attn.linear_attention(*t, causal=causal), reference.linear_attention(*x, causal=causal)
    if function == "linear_attention_backward":
        return (numba_attn.linear_attention_backward(t[3], *t[:3], causal=causal),
                reference.linear_attention_backward(x[3], *x[:3], causal=causal))
    return (numba_attn.causal_dot_product_backward(t[3], *t[:3]),
            reference.causal_dot_product_backward(x[3], *x[:3]))


def _fp8(torch, rng, host_descale: bool):
    """q's factors per kv head, copied from the host (their values in the key) or a device array beside a number
    for k (copied to the device as an array of the key's value)."""
    import numba_attn
    import reference
    from numba_attn.forward import wgmma_fp8

    if not hasattr(torch, "float8_e4m3fn") or not wgmma_fp8.supports(64):
        pytest.skip("needs Hopper and torch's float8_e4m3fn")
    codes = [reference.encode_e4m3(rng.standard_normal(s)) for s in [(1, 4, 300, 64), (1, 2, 300, 64),
                                                                       (1, 2, 300, 64)]]
    t = [torch.from_numpy(c).cuda().view(torch.float8_e4m3fn) for c in codes]
    factors = np.array([[0.5, 1.5]], np.float32)
    descale_q = factors if host_descale else torch.from_numpy(factors).cuda()
    got = numba_attn.flash_forward(*t, causal=True, descale_q=descale_q, descale_k=0.75, out_dtype="float16")
    return got, reference.attention_fp8(*codes, factors, 0.75, None, causal=True)


CASES = {
    "flash_forward simt float16 window": lambda torch, rng: _forward(torch, rng, "float16", backend="simt",
                                                                     window=(40, 8)),
    "flash_forward mma bfloat16 causal softcap": lambda torch, rng: _forward(torch, rng, "bfloat16", backend="mma",
                                                                             causal=True, softcap=20.0),
    "flash_forward float32 lse": lambda torch, rng: _forward(torch, rng, "float32", return_lse=True),
    "flash_backward bfloat16 deterministic window": lambda torch, rng: _backward(torch, rng, "bfloat16",
                                                                                 window=(40, 8)),
    "linear_attention float16 non-causal (recurrent)": lambda torch, rng: _linear(torch, rng, "float16",
                                                                                  "linear_attention"),
    "linear_attention bfloat16 non-causal (chunked)": lambda torch, rng: _linear(torch, rng, "bfloat16",
                                                                                 "linear_attention"),
    "linear_attention_backward float16 non-causal": lambda torch, rng: _linear(torch, rng, "float16",
                                                                               "linear_attention_backward"),
    "causal_dot_product_backward float16 (recurrent)": lambda torch, rng: _linear(torch, rng, "float16",
                                                                                  "causal_dot_product_backward"),
    "flash_forward fp8 device and number descales": lambda torch, rng: _fp8(torch, rng, False),
    "flash_forward fp8 host descales": lambda torch, rng: _fp8(torch, rng, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_function_replays_and_matches_reference(case, replays):  # noqa: F811
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(21)
    tolerance = 4e-2 if "fp8" in case else next(TOLERANCE[word] for word in case.split() if word in TOLERANCE)
    for call in range(3):
        _poison_free_blocks(torch)
        got, expected = CASES[case](torch, rng)
        pairs = list(zip(got, expected)) if isinstance(got, tuple) else [(got, expected)]
        for g, e in pairs:
            assert _rel(g.float().cpu().numpy(), e) < tolerance, (call, _rel(g.float().cpu().numpy(), e))
        assert len(replays) == call, f"call {call}: {len(replays)} replays"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_replayed_varlen_calls_follow_host_offsets(dtype, replays):  # noqa: F811
    """Host ``cu_seqlens`` A, A, B, A, B, A (one total and batch), as int64 NumPy arrays, a list and a torch CPU
    tensor (one key: the values), forward and backward: each call matches ``reference`` with its own offsets; a
    repeat of offsets replays, other offsets record a plan of their own; the last call replays on another stream
    (with its own copy of the schedule)."""
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference

    rng = np.random.default_rng(22)
    tolerance = TOLERANCE[dtype]
    a, b = [0, 100, 400, 600], [0, 1, 598, 600]
    steps = [(np.array(a, np.int64), 0), (list(a), 2), (np.array(b, np.int64), 2), (torch.tensor(a), 4),
             (np.array(b, np.int64), 6), (np.array(a, np.int64), 8)]
    side = torch.cuda.Stream()
    for step, (cu, replayed) in enumerate(steps):
        stream = side if step == len(steps) - 1 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _poison_free_blocks(torch)
            t, x = _tensors(torch, rng, [(600, 4, 64), (600, 2, 64), (600, 2, 64), (600, 4, 64)], dtype)
            out, lse = numba_attn.flash_forward_varlen(*t[:3], cu, cu, causal=True, return_lse=True)
            grads = numba_attn.flash_backward_varlen(t[3], *t[:3], out, lse, cu, cu, causal=True)
        torch.cuda.current_stream().wait_stream(stream)
        offsets = np.asarray(cu)
        assert _rel(out.float().cpu().numpy(), reference.attention_varlen(*x[:3], offsets, offsets,
                                                                           causal=True)) < tolerance, step
        for g, e in zip(grads, reference.attention_varlen_backward(x[3], *x[:3], offsets, offsets, causal=True)):
            assert _rel(g.float().cpu().numpy(), e) < tolerance, step
        assert len(replays) == replayed, (step, len(replays))
