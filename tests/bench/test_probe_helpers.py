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
