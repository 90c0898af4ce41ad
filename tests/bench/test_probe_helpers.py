"""scripts/_probe.py: a configuration forced past the tuner is part of the replay key, so that forced configurations
of one shape never replay each other's plans (CPU only: the key is checked where it is made)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))


def test_forced_config_enters_the_replay_key(monkeypatch):
    import _probe
    from numba_attn.forward import dispatch, wgmma_ws
    from numba_attn.runtime import replay

    seen = []
    monkeypatch.setattr(replay, "find", lambda name, arrays, options: seen.append((name, options)))
    monkeypatch.setattr(dispatch, "_tuned_config", dispatch._tuned_config)  # (restored after the test)
    _probe._patch_dispatch()
    config = wgmma_ws.WsConfig(persistent=True)
    _probe._FORCE["config"] = config
    try:
        replay.find("flash_forward", (), (True, 0.125))
    finally:
        _probe._FORCE["config"] = None
    replay.find("flash_forward", (), (True, 0.125))
    assert seen == [("flash_forward", (True, 0.125, ("forced config", config))),
                    ("flash_forward", (True, 0.125, ("forced config", None)))]
    for _, options in seen:  # (a plan's key is hashed)
        hash(options)
    assert dispatch._tuned_config.forced_by_probe


def test_forced_fp8_config_replaces_the_default(monkeypatch):
    import _probe
    from numba_attn.forward import dispatch, wgmma_ws, wgmma_ws_fp8
    from numba_attn.runtime import replay

    monkeypatch.setattr(replay, "find", replay.find)  # (all three restored after the test)
    monkeypatch.setattr(dispatch, "_tuned_config", dispatch._tuned_config)
    monkeypatch.setattr(wgmma_ws_fp8, "default_config", wgmma_ws_fp8.default_config)
    shipped = wgmma_ws_fp8.default_config()
    _probe.forced_fp8_forward(None, None, None, False)
    config = wgmma_ws.WsConfig(persistent=True)
    _probe._FORCE["config"] = config
    try:
        assert wgmma_ws_fp8.default_config() == config
    finally:
        _probe._FORCE["config"] = None
    assert wgmma_ws_fp8.default_config() == shipped


def test_alternating_rates_take_every_call_in_turn():
    import _probe

    order = []
    calls = {"cuDNN": lambda: "a", "ours": lambda: "b"}
    ms = iter([2.0, 1.0, 4.0, 1.0, 2.0, 2.0])  # (cuDNN, ours) per round

    def time_ms(fn):
        order.append(fn())
        return next(ms)

    rates = _probe.alternating_rates(calls, 4e9, 3, time_ms)
    assert order == ["a", "b"] * 3
    assert rates == {"cuDNN": [2.0, 1.0, 2.0], "ours": [4.0, 4.0, 2.0]}
    assert _probe.rates_line("D64 N1024 full", rates) == (
        "D64 N1024 full: cuDNN 2 [1-2] (1.000); ours 4 [2-4] (2.000)")
