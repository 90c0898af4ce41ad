"""The autotuner (``numba_attn._autotune``): choice by timing, in-memory and on-disk caching, and its use by
``flash_forward``'s tensor-core kernel.

The unmarked tests use a fake benchmark (tuning is switched on by hand: under the simulator it is off); the ``gpu``
tests time real kernels.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.runtime import autotune as _autotune
from tests.kernel_checks import TOLERANCE, rel_error


@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int
    keys: int


CANDIDATES = (Tiles(128, 64), Tiles(64, 64), Tiles(128, 32))


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on, the cache in a fresh directory."""
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(_autotune, "enabled", lambda: True)
    return tmp_path


class Bench:
    """A fake benchmark: fixed times per configuration, and a log of what was timed."""

    def __init__(self, times):
        self.times = times
        self.calls = []

    def __call__(self, config):
        self.calls.append(config)
        return self.times[config]


def test_chooses_the_fastest_and_times_each_candidate_once(tuning):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    bench = Bench({CANDIDATES[0]: 3.0, CANDIDATES[1]: 1.5, CANDIDATES[2]: 2.0})
    assert tuner.choose(("fp16", 64), bench) == CANDIDATES[1]
    assert sorted(bench.calls, key=repr) == sorted(CANDIDATES, key=repr)
    assert tuner.choose(("fp16", 64), bench) == CANDIDATES[1]
    assert len(bench.calls) == len(CANDIDATES)  # the second call took the remembered choice


def test_keys_are_tuned_separately(tuning):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    assert tuner.choose(("a",), Bench({CANDIDATES[0]: 1.0, CANDIDATES[1]: 2.0, CANDIDATES[2]: 3.0})) == CANDIDATES[0]
    assert tuner.choose(("b",), Bench({CANDIDATES[0]: 3.0, CANDIDATES[1]: 2.0, CANDIDATES[2]: 1.0})) == CANDIDATES[2]
    assert tuner.choose(("a",), Bench({})) == CANDIDATES[0]


def test_choice_persists_across_tuners(tuning):
    """A new process (a new tuner with the same name and cache directory) reads the choice instead of timing."""
    _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0]).choose(
        ("k", 1), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 2.5, CANDIDATES[2]: 0.5}))
    data = json.loads((tuning / "autotune-t.json").read_text())
    assert data["k|1"]["config"] == {"rows": 128, "keys": 32}
    assert len(data["k|1"]["timings"]) == len(CANDIDATES)
    fresh = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    bench = Bench({})
    assert fresh.choose(("k", 1), bench) == CANDIDATES[2] and bench.calls == []


def test_damaged_cache_file_is_tuned_again(tuning):
    (tuning / "autotune-t.json").write_text("{not json")
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    assert tuner.choose(("k",), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 3.0})) == CANDIDATES[1]
    assert json.loads((tuning / "autotune-t.json").read_text())["k"]["config"] == {"rows": 64, "keys": 64}


def test_entry_for_a_configuration_no_longer_offered_is_tuned_again(tuning):
    (tuning / "autotune-t.json").write_text(json.dumps({"k": {"config": {"rows": 256, "keys": 16}, "timings": {}}}))
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    bench = Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 3.0, CANDIDATES[2]: 1.0})
    assert tuner.choose(("k",), bench) == CANDIDATES[2] and len(bench.calls) == len(CANDIDATES)


def test_switched_off_takes_the_default_without_timing(monkeypatch, tmp_path):
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    bench = Bench({})
    assert not _autotune.enabled()
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[1]).choose(("k",), bench) == CANDIDATES[1]
    assert bench.calls == [] and not (tmp_path / "autotune-t.json").exists()


def test_candidates_must_contain_the_default():
    with pytest.raises(ValueError, match="candidates"):
        _autotune.Autotuner("t", CANDIDATES, Tiles(1, 1))
    with pytest.raises(ValueError, match="candidates"):
        _autotune.Autotuner("t", (), None)


def test_size_class():
    assert [_autotune.size_class(n) for n in (0, 1, 2, 4, 5, 16, 17, 1 << 20)] == [1, 1, 4, 4, 16, 16, 64, 1 << 20]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mma", "wgmma"])
def test_gpu_flash_forward_tunes_once_and_every_candidate_is_right(monkeypatch, tmp_path, backend):
    """On a GPU: the first call of a key times the candidates and writes the cache file; the result is right; the
    next call of the key does not time again. Each candidate alone also matches the reference."""
    import cupy
    from numba import cuda

    from numba_attn.forward import dispatch
    from numba_attn.runtime.device import compute_capability
    from numba_attn.forward import mma as flash_mma
    from numba_attn.forward import wgmma as flash_wgmma

    if backend == "wgmma" and compute_capability() < flash_wgmma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("wgmma needs compute capability 9.0")
    tuner, module = {"mma": (dispatch.FLASH_MMA_TUNER, flash_mma), "wgmma": (dispatch.FLASH_WGMMA_TUNER, flash_wgmma)}[backend]
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(_autotune.ENABLE_ENV, raising=False)
    tuner.forget()
    timed = []
    real_time = _autotune.time_on_stream
    monkeypatch.setattr(_autotune, "time_on_stream", lambda fn, stream, reps=_autotune.REPS: (
        timed.append(1), real_time(fn, stream, reps))[1])
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, n, 72)).astype(np.float16) for n in (1001, 777, 777))
    ref = reference.attention(q, k, v, causal=True)
    out = numba_attn.flash_forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True, backend=backend)
    assert rel_error(out.get(), ref) <= TOLERANCE["float16"]
    assert len(timed) == len(module.TUNING_CANDIDATES)
    data = json.loads((tmp_path / f"autotune-flash_{backend}.json").read_text())
    assert len(data) == 1 and list(data.values())[0]["config"] in [
        dataclasses.asdict(c) for c in module.TUNING_CANDIDATES]
    out = numba_attn.flash_forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True, backend=backend)
    assert len(timed) == len(module.TUNING_CANDIDATES)  # remembered
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    for config in module.TUNING_CANDIDATES:
        qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
        out = cupy.full(q.shape, np.nan, np.float16)
        lse = cupy.full(q.shape[:3], np.nan, np.float32)
        module.launch(*(cuda.as_cuda_array(x) for x in (qd, kd, vd, out, lse)), True, 1 / np.sqrt(72), True,
                      cuda.default_stream(), config=config)
        cuda.default_stream().synchronize()
        assert rel_error(out.get(), ref) <= TOLERANCE["float16"], config
    tuner.forget()
