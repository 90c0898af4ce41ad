#!/usr/bin/env python
"""Benchmark sweep of numba_attn against the installed peers (``--help``); the code is the ``bench`` package here."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (HERE, os.path.dirname(HERE)):  # bench/ lives next to this script; numba_attn at the repo root
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench.main import main  # noqa: E402

if __name__ == "__main__":
    main()
