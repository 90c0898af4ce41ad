"""scripts/_fields.py: the ``name=value,...`` text of ``--config``, ``--take`` and the probes' named configurations."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))


def test_fields_are_ints_bools_and_text():
    from _fields import parse_fields

    assert parse_fields("block_n=128, persistent=True,pingpong=false,split=kv,offset=-2,") == {
        "block_n": 128, "persistent": True, "pingpong": False, "split": "kv", "offset": -2}
    assert parse_fields("") == {}
    for bad in ("block_n", "=3", "block_n="):
        with pytest.raises(ValueError, match="expected name=value"):
            parse_fields(bad)


def test_named_configs_skip_plain_options():
    from _fields import named_configs
    from numba_attn.forward import wgmma_ws

    named = named_configs(["d=64", "p:block_n=128,persistent=True", "s3:stages=3"], wgmma_ws.WsConfig)
    assert named == {"p": wgmma_ws.WsConfig(block_n=128, persistent=True), "s3": wgmma_ws.WsConfig(stages=3)}
    with pytest.raises(ValueError, match="WsConfig.block_n"):
        named_configs(["x:block_n=17"], wgmma_ws.WsConfig)
