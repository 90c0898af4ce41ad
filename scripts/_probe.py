"""Callables that the GPU probes time (``from _probe import forced_forward, cudnn_forward``; the scripts' folder on
``sys.path``): ``flash_forward`` with a warp-specialised configuration forced past the tuned tables (16-bit) or
past the fp8 kernel's default, and torch SDPA's cuDNN backend as the peer. Each returns a no-argument function of the inputs it closes over.

A forced configuration is part of the call's replay key (``runtime.replay``): a plan is keyed by the call's arrays and
options only, so without it every configuration forced on one shape would replay the plan of the first one timed.
Calls may then be replayed (``NUMBA_ATTN_REPLAY=1``, less host time per call), each configuration from its own plan."""
from __future__ import annotations

_FORCE = {"config": None}


def _patch_dispatch():
    from numba_attn.forward import dispatch
    from numba_attn.runtime import replay

    if getattr(dispatch._tuned_config, "forced_by_probe", False):
        return
    tuned = dispatch._tuned_config
    find = replay.find

    def forced_or_tuned(*args, **kwargs):
        return _FORCE["config"] or tuned(*args, **kwargs)

    def find_with_config(name, arrays, options):
        return find(name, arrays, tuple(options) + (("forced config", _FORCE["config"]),))

    forced_or_tuned.forced_by_probe = True
    dispatch._tuned_config = forced_or_tuned
    replay.find = find_with_config


def forced_forward(q, k, v, causal: bool, config=None, backend: str | None = "wgmma_ws", window=None):
    """``flash_forward(q, k, v, causal=..., backend=..., window=...)`` with the tuner's choice replaced by ``config``
    (None: the tuned choice, as users get it)."""
    import numba_attn

    _patch_dispatch()
    return _forced(config, lambda: numba_attn.flash_forward(q, k, v, causal=causal, backend=backend, window=window))


def _forced(config, fn):
    """``fn`` as a call with ``config`` forced while it runs."""
    def call():
        _FORCE["config"] = config
        try:
            fn()
        finally:
            _FORCE["config"] = None
    return call


def _patch_fp8():
    from numba_attn.forward import wgmma_ws_fp8

    if getattr(wgmma_ws_fp8.default_config, "forced_by_probe", False):
        return
    shipped = wgmma_ws_fp8.default_config

    def forced_or_default():
        return _FORCE["config"] or shipped()

    forced_or_default.forced_by_probe = True
    wgmma_ws_fp8.default_config = forced_or_default


def forced_fp8_forward(q, k, v, causal: bool, config=None):
    """``flash_forward(q, k, v, causal=..., backend="wgmma_ws")`` on float8 inputs with the fp8 WS kernel's
    configuration replaced by ``config`` (None: its default)."""
    import numba_attn

    _patch_dispatch()  # (the replay key)
    _patch_fp8()
    return _forced(config, lambda: numba_attn.flash_forward(q, k, v, causal=causal, backend="wgmma_ws"))


def cudnn_forward(q, k, v, causal: bool):
    """torch SDPA on its cuDNN backend."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def alternating_rates(calls: dict, flops: float, rounds: int, time_ms) -> dict:
    """TFLOP/s of each of ``calls`` (name -> function) over ``rounds`` rounds that take every call in turn, so that
    a drift of the machine's clocks reaches every call alike; ``time_ms(fn)`` times one call."""
    rates = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            rates[name].append(flops / time_ms(fn) / 1e9)
    return rates


def rates_line(label: str, rates: dict, reference: str = "cuDNN") -> str:
    """``label: name median [min-max] (median over the reference's median); ...`` of ``alternating_rates``."""
    import statistics

    ref = statistics.median(rates[reference])
    return f"{label}: " + "; ".join(f"{name} {statistics.median(r):.0f} [{min(r):.0f}-{max(r):.0f}] "
                                    f"({statistics.median(r) / ref:.3f})" for name, r in rates.items())
