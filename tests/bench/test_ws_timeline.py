"""scripts/ws_timeline.py rewrites the WS kernel's source at exact lines (CPU): its anchors must still be found once
each, and the stamped copy must still be Python, as the kernel changes."""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import ws_timeline  # noqa: E402


def test_the_timeline_finds_its_anchors():
    with open(os.path.join(ROOT, "numba_attn", "forward", "wgmma_ws_kernel.py")) as f:
        src = ws_timeline.rewritten_source(f.read())
    ast.parse(src)
    # six consumer phases and the producer's stamps, in the dense and the persistent blocks
    assert src.count("_gtimer()") == 12
