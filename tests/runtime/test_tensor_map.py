"""TMA building blocks: ``runtime.tensor_map`` (which arrays the TMA reads, the map cache) and, under the simulator,
the twins of ``core.ptx.tma`` through ``scripts/check_tma.py``'s kernel (mbarrier phases, swizzled boxes, zero fill).
On a GPU ``scripts/check_tma.py`` itself runs the real instructions."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from numba_attn.core.ptx import tma
from numba_attn.runtime import tensor_map
from numba_attn.runtime.device import SIMULATOR, DeviceView

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))


def _view(shape, strides, ptr=4096):
    return DeviceView(ptr, shape, strides, np.float16, None)


def test_tma_layout_rules():
    assert tensor_map.tma_layout_ok(_view((2, 3, 100, 64), (3 * 100 * 128, 100 * 128, 128, 2)))
    assert tensor_map.tma_layout_ok(_view((2, 3, 100, 64), (100 * 3 * 128, 128, 3 * 128, 2)))  # (b, l, h, d) view
    assert not tensor_map.tma_layout_ok(_view((2, 3, 100, 64), (3 * 100 * 128, 100 * 128, 128, 2), ptr=4098))
    assert not tensor_map.tma_layout_ok(_view((2, 3, 100, 60), (3 * 100 * 120, 100 * 120, 120, 2)))  # 120-byte rows
    assert not tensor_map.tma_layout_ok(_view((1, 1, 100, 64), (100 * 256, 100 * 256, 256, 4)))  # last axis strided
    assert tensor_map.tma_layout_ok(_view((1, 1, 100, 64), (8, 8, 128, 2)))  # unit axes: any stride
    assert not tensor_map.tma_layout_ok(DeviceView(4096, (1, 1, 4, 8), (128, 128, 32, 4), np.float32, None))


def test_map_geometry_is_innermost_first():
    dims, strides, box = tensor_map._map_geometry((2, 3, 100, 64), (3 * 100 * 128, 100 * 128, 128, 2), 176)
    assert dims == (64, 100, 3, 2) and strides == (128, 100 * 128, 3 * 100 * 128) and box == (64, 176, 1, 1)


def test_setmaxnreg_counts_are_checked():
    with pytest.raises(ValueError, match="setmaxnreg"):
        tma.setmaxnreg_dec(20)
    with pytest.raises(ValueError, match="setmaxnreg"):
        tma.setmaxnreg_inc(244)


@pytest.mark.skipif(not SIMULATOR, reason="scripts/check_tma.py covers this on a GPU")
def test_simulated_tma_tiles_and_map_cache():
    import check_tma

    for name, *args in check_tma.SIM_CASES:
        status, detail = check_tma.run_case(name, *args)
        assert status == "PASS", f"{name}: {detail}"
