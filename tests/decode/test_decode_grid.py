"""Every decode launch stays within the device's grid limits (``runtime.device.max_grid``), checked with small
limits: a call whose grid would pass them takes another kernel, fewer splits, or raises a ValueError naming the
argument. (Issue #26: ``flash_decode`` does not check the query length; long query blocks put more than 65535 row
tiles on the tensor-core split kernel's grid y.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numba_attn
from numba_attn.decode import combine as decode_combine
from numba_attn.decode import dispatch
from numba_attn.decode import launch as decode_launch
from numba_attn.decode import simt as decode
from numba_attn.runtime import device
from numba_attn.runtime import launch as runtime_launch
from numba_attn.runtime.attention_args import AttentionArgs
from numba_attn.runtime.shapes import attention_shape
from tests.decode_checks import check_attention, dev, qkv

#: grid limits (x, y, z) small enough for simulator-sized calls to reach them
LIMITS = (40, 2, 3)


@pytest.fixture
def small_grid(monkeypatch):
    """The device reports ``LIMITS``; every decode launch's grid is recorded and checked against them."""
    real = device.device_properties
    monkeypatch.setattr(device, "device_properties",
                        lambda device_id=None: dataclasses.replace(real(device_id), max_grid=LIMITS))
    monkeypatch.setattr(runtime_launch, "FAST_LAUNCH", False)  # (on a GPU: every launch through device_launch)
    grids = []
    for module in (decode, decode_combine, decode_launch):
        def checked(kernel, grid, *args, _launch=module.device_launch):
            grid = grid if isinstance(grid, tuple) else (grid,)
            assert all(n <= limit for n, limit in zip(grid, LIMITS)), f"grid {grid} past the limits {LIMITS}"
            grids.append(grid)
            _launch(kernel, grid, *args)

        monkeypatch.setattr(module, "device_launch", checked)
    return grids


def _takes_tensor_cores(q, k, v) -> bool:
    args = AttentionArgs(q, k, v, np.zeros(q.shape, q.dtype), np.zeros(q.shape[:3], np.float32), True, 1.0, False)
    return dispatch.on_tensor_cores(str(q.dtype), attention_shape(q, k, v), args) is not None


def test_more_row_tiles_than_grid_y_take_the_simt_kernel(small_grid):
    # GQA 8 x 5 tokens: 40 rows per kv head, 3 row tiles for a grid y of 2
    q, k, v = qkv(np.random.default_rng(60), 1, 8, 1, 5, 40, 16, "float16")
    assert not _takes_tensor_cores(q, k, v)
    out, lse = numba_attn.flash_decode(dev(q), dev(k), dev(v), num_splits=3, return_lse=True)
    check_attention(out, lse, q, k, v, False)
    assert small_grid == [(1, 2), (40,)]  # SIMT: (batch * kv_heads, splits), clamped to grid y; combine: a row each


def test_more_rows_than_the_combine_grid_take_one_split(small_grid):
    # 2 heads x 24 tokens = 48 rows for the combine's grid x of 40: one split writes out itself
    q, k, v = qkv(np.random.default_rng(61), 1, 2, 2, 24, 30, 8, "float16")
    assert not _takes_tensor_cores(q, k, v)
    out, lse = numba_attn.flash_decode(dev(q), dev(k), dev(v), num_splits=2, return_lse=True)
    check_attention(out, lse, q, k, v, False)
    assert small_grid == [(2, 1)]


def test_tensor_core_plans_stay_within_grid_z(small_grid):
    q, k, v = qkv(np.random.default_rng(62), 1, 8, 1, 1, 200, 16, "float16")
    assert _takes_tensor_cores(q, k, v)
    out, lse = numba_attn.flash_decode(dev(q), dev(k), dev(v), num_splits=100, return_lse=True)
    check_attention(out, lse, q, k, v, False)
    assert small_grid[0][2] == LIMITS[2]  # 7 key tiles, 100 splits asked for: as many as grid z takes
    rows = q.reshape(1, 1, 8, 16)
    for num_splits, sm_count, seqlen_k in ((100, 1, 200), (None, 132, 1 << 20)):
        launch = decode_launch.DecodeLaunch(rows, rows, False, 1.0, num_splits, sm_count, dtype="float16")
        assert launch.plan(seqlen_k).num_splits <= LIMITS[2]


def test_grids_past_the_limits_raise_naming_the_argument(small_grid):
    with pytest.raises(ValueError, match="o_parts"):
        numba_attn.combine_lse(np.zeros((2, 41, 4), np.float32), np.zeros((2, 41), np.float32))
    q, k, v = qkv(np.random.default_rng(63), 41, 1, 1, 1, 3, 4, "float32")
    with pytest.raises(ValueError, match="k: batch"):
        numba_attn.flash_decode(q, k, v)  # 41 (batch, kv head) blocks for a grid x of 40
    o_parts = np.zeros((3, 1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="num_splits"):
        decode.launch_split(q[:1], k[:1], v[:1], o_parts, o_parts[..., 0], True, 1.0, False, 0)
    rows = np.zeros((1, 1, 40, 16), np.float16)
    with pytest.raises(ValueError, match="q: "):
        decode_launch.DecodeLaunch(rows, rows, False, 1.0, None, 1, dtype="float16")
    assert small_grid == []
