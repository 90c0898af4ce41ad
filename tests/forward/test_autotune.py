"""How ``flash_forward``'s tile configurations are chosen (``numba_attn.runtime.autotune``): the user's tuned choices,
the shipped tables per GPU family, the defaults; tuning only when asked (``NUMBA_ATTN_AUTOTUNE``,
``numba_attn.autotune()``), never inside a CUDA-graph capture; the tables shipped in the package.

The unmarked tests use a fake benchmark and switch the simulator off for the mode logic where they need to (under
the simulator nothing is tuned); the ``gpu`` tests time real kernels.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import threading
import types

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.forward import dispatch
from numba_attn.forward import mma as flash_mma
from numba_attn.forward import wgmma as flash_wgmma
from numba_attn.runtime import autotune as _autotune
from tests.kernel_checks import TOLERANCE, rel_error


@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int
    keys: int


CANDIDATES = (Tiles(128, 64), Tiles(64, 64), Tiles(128, 32))


def key(*fields, sizes=(4096, 1024), family="sm90", sms=132) -> _autotune.Key:
    return _autotune.Key(family, sms, fields or ("float16", 64, False), sizes)


def write_table(directory, entries: dict, name="t", family="sm90") -> None:
    """A shipped table for tuner ``name``: ``{table key text: candidate}``."""
    data = {"family": family, "tuners": {name: {"entries": {
        text: {"config": dataclasses.asdict(config)} for text, config in entries.items()}}}}
    (directory / f"{family}.json").write_text(json.dumps(data))


@pytest.fixture
def tables(tmp_path):
    path = tmp_path / "tables"
    path.mkdir()
    return path


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The user's choices in a fresh directory; the simulator's own "no tuning" switched off, the variable unset."""
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(_autotune.ENABLE_ENV, raising=False)
    monkeypatch.setattr(_autotune, "SIMULATOR", False)
    return tmp_path / "cache"


@pytest.fixture
def tuning(cache, monkeypatch):
    """Tuning on (NUMBA_ATTN_AUTOTUNE=1), the cache in a fresh directory."""
    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    return cache


class Bench:
    """A fake benchmark: fixed times per configuration, and a log of what was timed."""

    def __init__(self, times):
        self.times = times
        self.calls = []

    def __call__(self, config):
        self.calls.append(config)
        return self.times[config]


NEVER = Bench({})  # any call fails (KeyError): for lookups that must not time


def never_asked():
    raise AssertionError("the capture state was asked although nothing was to be tuned")


# -- tuning ---------------------------------------------------------------------------------------------------------
def test_chooses_the_fastest_and_times_each_candidate_once(tuning):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    bench = Bench({CANDIDATES[0]: 3.0, CANDIDATES[1]: 1.5, CANDIDATES[2]: 2.0})
    assert tuner.choose(key(), bench) == CANDIDATES[1]
    assert sorted(bench.calls, key=repr) == sorted(CANDIDATES, key=repr)
    assert tuner.choose(key(), bench) == CANDIDATES[1]
    assert len(bench.calls) == len(CANDIDATES)  # the second call took the remembered choice
    assert tuner.timings[key().text] == {repr(c): t for c, t in bench.times.items()}


def test_keys_are_tuned_separately(tuning):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    a, b = key("a"), key("b")
    assert tuner.choose(a, Bench({CANDIDATES[0]: 1.0, CANDIDATES[1]: 2.0, CANDIDATES[2]: 3.0})) == CANDIDATES[0]
    assert tuner.choose(b, Bench({CANDIDATES[0]: 3.0, CANDIDATES[1]: 2.0, CANDIDATES[2]: 1.0})) == CANDIDATES[2]
    assert tuner.choose(a, NEVER) == CANDIDATES[0]


def test_choice_persists_across_tuners(tuning, monkeypatch):
    """A new process (a new tuner with the same name and cache directory) reads the choice instead of timing, in
    every mode but 0. The file keeps today's key text (SM count included)."""
    _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0]).choose(
        key("k", 1), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 2.5, CANDIDATES[2]: 0.5}))
    data = json.loads((tuning / "autotune-t.json").read_text())
    assert data["sm90|132|k|1|4096|1024"]["config"] == {"rows": 128, "keys": 32}
    assert len(data["sm90|132|k|1|4096|1024"]["timings"]) == len(CANDIDATES)
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0]).choose(key("k", 1), NEVER) == CANDIDATES[2]
    monkeypatch.delenv(_autotune.ENABLE_ENV)
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0]).choose(key("k", 1), NEVER) == CANDIDATES[2]


def test_a_tuned_choice_holds_for_its_sm_count_only(tuning, tables, monkeypatch):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    tuner.choose(key(sms=132), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 3.0}))
    monkeypatch.delenv(_autotune.ENABLE_ENV)
    assert tuner.choose(key(sms=132), NEVER) == CANDIDATES[1]
    assert tuner.choose(key(sms=114), NEVER, never_asked) == CANDIDATES[0]  # another H100 model: default


def test_damaged_cache_file_is_tuned_again(tuning):
    tuning.mkdir()
    (tuning / "autotune-t.json").write_text("{not json")
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    assert tuner.choose(key(), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 3.0})) == CANDIDATES[1]
    assert json.loads((tuning / "autotune-t.json").read_text())[key().text]["config"] == {"rows": 64, "keys": 64}


def test_entry_for_a_configuration_no_longer_offered_is_tuned_again(tuning):
    tuning.mkdir()
    (tuning / "autotune-t.json").write_text(json.dumps(
        {key().text: {"config": {"rows": 256, "keys": 16}, "timings": {}}}))
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    bench = Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 3.0, CANDIDATES[2]: 1.0})
    assert tuner.choose(key(), bench) == CANDIDATES[2] and len(bench.calls) == len(CANDIDATES)


def test_tuning_mode_tunes_keys_the_shipped_table_has(tuning, tables):
    write_table(tables, {key().table_text: CANDIDATES[1]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    assert tuner.choose(key(), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 3.0, CANDIDATES[2]: 1.0})) == CANDIDATES[2]


def test_candidates_must_contain_the_default():
    with pytest.raises(ValueError, match="candidates"):
        _autotune.Autotuner("t", CANDIDATES, Tiles(1, 1))
    with pytest.raises(ValueError, match="candidates"):
        _autotune.Autotuner("t", (), None)


def test_size_class():
    assert [_autotune.size_class(n) for n in (0, 1, 2, 4, 5, 16, 17, 1 << 20)] == [1, 1, 4, 4, 16, 16, 64, 1 << 20]


def test_key_texts():
    k = _autotune.Key("sm90", 132, ("bfloat16", 128, True), (262144, 1024))
    assert k.text == "sm90|132|bfloat16|128|True|262144|1024"
    assert k.table_text == "bfloat16|128|True|262144|1024"


# -- modes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    (None, _autotune.CACHED), ("", _autotune.CACHED), ("1", _autotune.TUNE), ("true", _autotune.TUNE),
    (" ON ", _autotune.TUNE), ("0", _autotune.OFF), ("no", _autotune.OFF), ("off", _autotune.OFF)])
def test_mode_from_the_environment(cache, monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(_autotune.ENABLE_ENV, value)
    assert _autotune.mode() == expected


def test_mode_rejects_other_values(cache, monkeypatch):
    monkeypatch.setenv(_autotune.ENABLE_ENV, "auto")
    with pytest.raises(ValueError, match=_autotune.ENABLE_ENV):
        _autotune.mode()


def test_context_manager_is_reentrant_and_public(cache):
    assert numba_attn.autotune is _autotune.autotune
    assert _autotune.mode() == _autotune.CACHED
    with numba_attn.autotune():
        assert _autotune.mode() == _autotune.TUNE
        with numba_attn.autotune():
            assert _autotune.mode() == _autotune.TUNE
        assert _autotune.mode() == _autotune.TUNE
    assert _autotune.mode() == _autotune.CACHED
    with pytest.raises(RuntimeError):
        with numba_attn.autotune():
            raise RuntimeError("the depth is restored on errors too")
    assert _autotune.mode() == _autotune.CACHED


def test_context_manager_is_per_thread(cache):
    inside, checked = threading.Event(), threading.Event()
    seen = []

    def other():
        inside.wait(10)
        seen.append(_autotune.mode())
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with numba_attn.autotune():
        inside.set()
        checked.wait(10)
        assert _autotune.mode() == _autotune.TUNE
    thread.join(10)
    assert seen == [_autotune.CACHED]


def test_zero_wins_over_the_context_manager(cache, monkeypatch):
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    with numba_attn.autotune():
        assert _autotune.mode() == _autotune.OFF


def test_the_simulator_never_tunes(monkeypatch):
    monkeypatch.setattr(_autotune, "SIMULATOR", True)
    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    with numba_attn.autotune():
        assert _autotune.mode() == _autotune.OFF


def test_without_tuning_a_new_key_is_not_timed(cache, tables):
    """The default mode: no timing (and no capture query) in any call; the shipped table, else the default."""
    write_table(tables, {key().table_text: CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    assert tuner.choose(key(), NEVER, never_asked) == CANDIDATES[2]
    assert tuner.choose(key("bfloat16", 64, False), NEVER, never_asked) == CANDIDATES[0]
    assert not cache.exists()


def test_user_tuned_choice_beats_the_shipped_table(cache, tables, monkeypatch):
    write_table(tables, {key().table_text: CANDIDATES[2]})
    cache.mkdir()
    (cache / "autotune-t.json").write_text(json.dumps({key().text: {"config": {"rows": 64, "keys": 64}}}))
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables)).choose(key(), NEVER) == CANDIDATES[1]
    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables)).choose(key(), NEVER) == CANDIDATES[1]
    # 0: the shipped table only, the user's file not even read
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables)).choose(key(), NEVER) == CANDIDATES[2]


def test_switched_off_takes_the_default_without_timing(cache, monkeypatch):
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    bench = Bench({})
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[1]).choose(key(), bench, never_asked) == CANDIDATES[1]
    assert bench.calls == [] and not cache.exists()


def test_the_context_manager_tunes_only_inside(cache):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0])
    assert tuner.choose(key(), NEVER, never_asked) == CANDIDATES[0]
    with numba_attn.autotune():
        assert tuner.choose(key(), Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 3.0}),
                            lambda: False) == CANDIDATES[1]
    assert tuner.choose(key(), NEVER, never_asked) == CANDIDATES[1]  # the tuned choice stays
    assert json.loads((cache / "autotune-t.json").read_text())[key().text]["config"] == {"rows": 64, "keys": 64}


def test_no_tuning_while_the_stream_is_captured(tuning, tables):
    write_table(tables, {key().table_text: CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    assert tuner.choose(key(), NEVER, lambda: True) == CANDIDATES[2]  # the shipped choice
    assert tuner.choose(key("bfloat16", 64, False), NEVER, lambda: True) == CANDIDATES[0]  # no entry: the default
    assert not (tuning / "autotune-t.json").exists()
    # the key stays untuned: the next call outside a capture tunes it
    bench = Bench({CANDIDATES[0]: 2.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 3.0})
    assert tuner.choose(key(), bench, lambda: False) == CANDIDATES[1] and len(bench.calls) == len(CANDIDATES)


# -- the shipped table ----------------------------------------------------------------------------------------------
def table_of(entries: dict) -> _autotune.TunedTable:
    return _autotune.TunedTable(entries)


def test_lookup_exact_entry():
    table = table_of({"float16|64|False|4096|1024": CANDIDATES[1], "float16|64|True|4096|1024": CANDIDATES[2]})
    assert table.lookup(key("float16", 64, False)) == CANDIDATES[1]
    assert table.lookup(key("float16", 64, True)) == CANDIDATES[2]


def test_lookup_nearest_size_class_with_the_same_other_fields():
    table = table_of({
        "float16|64|False|262144|1024": CANDIDATES[0],
        "float16|64|False|4194304|16384": CANDIDATES[1],
        "float16|128|False|1048576|4096": CANDIDATES[2],  # another head dim: never for a head dim 64 key
    })
    assert table.lookup(key(sizes=(1048576, 4096))) == CANDIDATES[1]  # equally far: the larger sizes
    assert table.lookup(key(sizes=(65536, 1024))) == CANDIDATES[0]
    assert table.lookup(key(sizes=(262144, 4096))) == CANDIDATES[0]
    assert table.lookup(key(sizes=(16777216, 16384))) == CANDIDATES[1]
    assert table.lookup(key(sizes=(4096, 4096))) == CANDIDATES[0]
    assert table.lookup(key("float16", 128, False, sizes=(16, 16))) == CANDIDATES[2]
    assert table.lookup(key("float16", 64, True)) is None  # no entry with these fields
    assert table.lookup(key("bfloat16", 64, False)) is None


def test_missing_table_or_entry_gives_the_default(cache, tables):
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[1], str(tables))
    assert tuner.choose(key(), NEVER) == CANDIDATES[1]  # no sm90.json
    assert tuner.choose(key(family="sm80"), NEVER) == CANDIDATES[1]
    write_table(tables, {"bfloat16|64|False|4096|1024": CANDIDATES[2]}, family="sm80")
    tuner.forget()
    assert tuner.choose(key(family="sm80"), NEVER) == CANDIDATES[1]  # no entry with float16
    assert tuner.choose(key("bfloat16", 64, False, family="sm80", sizes=(16, 16)), NEVER) == CANDIDATES[2]
    assert _autotune.Autotuner("t", CANDIDATES, CANDIDATES[1]).choose(key(), NEVER) == CANDIDATES[1]  # no tables


def test_table_entries_that_are_not_candidates_are_left_out(tables):
    data = {"tuners": {"t": {"entries": {
        "float16|64|False|4096|1024": {"config": {"rows": 256, "keys": 16}},
        "float16|64|True|4096|1024": {"config": {"rows": 64, "keys": 64}},
        "float16|64|True|16|16": "not an entry"}}}}
    (tables / "sm90.json").write_text(json.dumps(data))
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    table, problems = _autotune.TunedTable.read(str(tables / "sm90.json"), tuner)
    assert table.entries == {"float16|64|True|4096|1024": CANDIDATES[1]} and len(problems) == 2
    (tables / "sm80.json").write_text("{damaged")
    assert _autotune.TunedTable.read(str(tables / "sm80.json"), tuner)[1]
    for shape in ([], {"tuners": []}, {"tuners": {"t": {"entries": []}}}):
        (tables / "sm86.json").write_text(json.dumps(shape))
        table, problems = _autotune.TunedTable.read(str(tables / "sm86.json"), tuner)
        assert table.entries == {} and problems, shape
    (tables / "sm86.json").write_text(json.dumps({"tuners": {"other": {"entries": {}}}}))
    assert _autotune.TunedTable.read(str(tables / "sm86.json"), tuner)[1] == []  # no section for this tuner
    assert tuner.shipped(key(family="sm80")) == CANDIDATES[0]


SHIPPED = sorted(glob.glob(os.path.join(dispatch.TABLE_DIR, "*.json")))


def test_a_table_ships_for_hopper():
    assert os.path.join(dispatch.TABLE_DIR, "sm90.json") in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_tables_hold_valid_candidates(path):
    """Every configuration of every shipped table constructs (which validates it) and is a candidate of its tuner;
    every key has the fields ``dispatch.tuning_key`` makes, without the SM count."""
    with open(path) as f:
        data = json.load(f)
    family = os.path.basename(path)[:-len(".json")]
    assert data["family"] == family and family.startswith("sm") and family[2:].isdigit()
    tuners = {tuner.name: tuner for tuner in dispatch.TUNERS}
    assert set(data["tuners"]) <= set(tuners)
    for name, section in data["tuners"].items():
        tuner = tuners[name]
        for text, entry in section["entries"].items():
            config = type(tuner.default)(**entry["config"])
            assert config in tuner.candidates, (name, text)
            dtype, head_dim, causal, rows, keys = text.split("|")
            assert dtype in flash_mma.DTYPES and causal in ("True", "False"), text
            assert int(head_dim) == flash_mma.padded_head_dim(int(head_dim)), text
            assert all(_autotune.size_class(int(n)) == int(n) for n in (rows, keys)), text
            timings = entry.get("timings_ms") or {}  # one shape's {candidate: ms}, or a list of them per shape
            for per_shape in timings if isinstance(timings, list) else [timings]:
                for timed in per_shape:
                    assert timed in {repr(c) for c in tuner.candidates}, (name, text, timed)
        assert _autotune.TunedTable.read(path, tuner)[1] == []
        assert type(tuner.default)(**section.get("default", dataclasses.asdict(tuner.default))) == tuner.default


# -- flash_forward ----------------------------------------------------------------------------------------------
def test_tuning_key_of_flash_forward():
    k = dispatch.tuning_key("float16", 72, True, 2, 3, 1001, 777)
    assert k.fields == ("float16", 80, True) and k.sizes == (16384, 1024)
    assert k.family == "sm%d%d" % dispatch.compute_capability() and k.sms == dispatch.multiprocessor_count()
    windowed = dispatch.tuning_key("float16", 72, True, 2, 3, 1001, 777, ("softcap", "window"))
    assert windowed.fields == ("float16", 80, True, "softcap+window") and windowed.sizes == k.sizes


class FakeLaunch:
    def __init__(self):
        self.configs = []

    def __call__(self, *args, config=None, dtype=None, **variant):
        self.configs.append(config)


def forward_call(monkeypatch, capturing: bool):
    """What ``dispatch._tuned_config`` needs of a call, on a pretend sm90 GPU whose stream is (or is not) captured."""
    monkeypatch.setattr(dispatch, "SIMULATOR", False)
    monkeypatch.setattr(dispatch, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(dispatch, "multiprocessor_count", lambda: 132)
    asked = []
    monkeypatch.setattr(dispatch._launch, "stream_capturing", lambda handle: asked.append(handle) or capturing)
    monkeypatch.setattr(_autotune, "time_on_stream", lambda fn, stream, reps=None: (fn(), 1.0)[1])
    call = types.SimpleNamespace(dtype="float16", stream=7, scratch=lambda shape, dtype: np.zeros(shape, np.float16))
    shape = types.SimpleNamespace(head_dim=64, batch=4, heads=48, seqlen_q=1024, seqlen_k=1024,
                                  out_shape=lambda: (4, 48, 1024, 64))
    args = types.SimpleNamespace(causal=False, variant_options=dict,
                                 writing=lambda *a: types.SimpleNamespace(launch_args=lambda: (),
                                                                          variant_options=dict))
    return call, shape, args, asked


@pytest.mark.parametrize("capturing", [False, True])
def test_flash_forward_never_tunes_while_its_stream_is_captured(cache, tables, monkeypatch, capturing):
    write_table(tables, {"float16|64|False|262144|1024": CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    call, shape, args, asked = forward_call(monkeypatch, capturing)
    launch = FakeLaunch()
    with numba_attn.autotune():
        config = dispatch._tuned_config(tuner, launch, args, call, shape, None)
    assert asked == [7]  # the call's stream
    if capturing:
        assert config == CANDIDATES[2] and launch.configs == []
    else:
        assert config in CANDIDATES and sorted(launch.configs, key=repr) == sorted(CANDIDATES, key=repr)


def test_flash_forward_without_tuning_asks_nothing_of_the_stream(cache, tables, monkeypatch):
    write_table(tables, {"float16|64|False|262144|1024": CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    call, shape, args, asked = forward_call(monkeypatch, False)
    launch = FakeLaunch()
    assert dispatch._tuned_config(tuner, launch, args, call, shape, None) == CANDIDATES[2]
    assert asked == [] and launch.configs == []


def windowed(args):
    """``args`` of a call with a sliding window (its variant options, also in the scratch it tunes into)."""
    options = lambda: {"window": (64, 0)}  # noqa: E731
    return types.SimpleNamespace(causal=args.causal, variant_options=options,
                                 writing=lambda *a: types.SimpleNamespace(launch_args=lambda: (),
                                                                          variant_options=options))


def test_a_windowed_call_tunes_its_own_key(cache, tables, monkeypatch):
    # tuning a windowed call must not set the plain calls' choice: they keep the shipped entry
    write_table(tables, {"float16|64|False|262144|1024": CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    call, shape, args, _ = forward_call(monkeypatch, False)
    launch = FakeLaunch()
    cost = {CANDIDATES[0]: 3.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 2.0}
    monkeypatch.setattr(_autotune, "time_on_stream", lambda fn, stream, reps=None: (fn(), cost[launch.configs[-1]])[1])
    with numba_attn.autotune():
        assert dispatch._tuned_config(tuner, launch, windowed(args), call, shape, None) == CANDIDATES[1]
    assert dispatch._tuned_config(tuner, launch, args, call, shape, None) == CANDIDATES[2]
    assert dispatch._tuned_config(tuner, launch, windowed(args), call, shape, None) == CANDIDATES[1]
    assert set(json.loads((cache / "autotune-t.json").read_text())) == {"sm90|132|float16|64|False|window|262144|1024"}


def test_an_untuned_windowed_call_takes_the_plain_choice_adjusted(cache, tables, monkeypatch):
    # without a choice of its own a windowed call takes the plain calls' (the shipped one, then the user's), passed
    # through the kernel's adjustment (the WS kernel's persistent form for windows)
    write_table(tables, {"float16|64|False|262144|1024": CANDIDATES[2]})
    tuner = _autotune.Autotuner("t", CANDIDATES, CANDIDATES[0], str(tables))
    call, shape, args, _ = forward_call(monkeypatch, False)
    launch = FakeLaunch()

    def narrow(config):
        return dataclasses.replace(config, keys=16)
    got = dispatch._tuned_config(tuner, launch, windowed(args), call, shape, None, None, narrow)
    assert got == narrow(CANDIDATES[2]) and launch.configs == []
    cost = {CANDIDATES[0]: 1.0, CANDIDATES[1]: 3.0, CANDIDATES[2]: 2.0}
    monkeypatch.setattr(_autotune, "time_on_stream", lambda fn, stream, reps=None: (fn(), cost[launch.configs[-1]])[1])
    with numba_attn.autotune():
        assert dispatch._tuned_config(tuner, launch, args, call, shape, None) == CANDIDATES[0]  # the user's, now
    assert dispatch._tuned_config(tuner, launch, windowed(args), call, shape, None, None, narrow) == \
        narrow(CANDIDATES[0])


@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the simulator's case")
def test_flash_forward_under_the_simulator_takes_the_simulator_configuration(tuning):
    assert dispatch._tuned_config(dispatch.FLASH_MMA_TUNER, None, None, None, None, None) is None


# -- on a GPU ---------------------------------------------------------------------------------------------------
def _tuners_of(backend):
    return {"mma": (dispatch.FLASH_MMA_TUNER, flash_mma), "wgmma": (dispatch.FLASH_WGMMA_TUNER, flash_wgmma)}[backend]


def _skip_without(backend):
    from numba_attn.runtime.device import compute_capability

    if backend == "wgmma" and compute_capability() < flash_wgmma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("wgmma needs compute capability 9.0")


def _count_timings(monkeypatch):
    timed = []
    real_time = _autotune.time_on_stream
    monkeypatch.setattr(_autotune, "time_on_stream", lambda fn, stream, reps=None: (
        timed.append(1), real_time(fn, stream, reps))[1])
    return timed


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mma", "wgmma"])
def test_gpu_flash_forward_tunes_once_when_asked_and_every_candidate_is_right(monkeypatch, tmp_path, backend):
    """On a GPU: a first call outside ``autotune()`` times nothing; inside, the first call of a key times the
    candidates and writes the cache file; the result is right; the next call of the key does not time again. Each
    candidate alone also matches the reference."""
    import cupy
    from numba import cuda

    _skip_without(backend)
    tuner, module = _tuners_of(backend)
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(_autotune.ENABLE_ENV, raising=False)
    tuner.forget()
    timed = _count_timings(monkeypatch)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, n, 72)).astype(np.float16) for n in (1001, 777, 777))
    ref = reference.attention(q, k, v, causal=True)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = numba_attn.flash_forward(qd, kd, vd, causal=True, backend=backend)
    assert rel_error(out.get(), ref) <= TOLERANCE["float16"]
    assert timed == [] and not (tmp_path / f"autotune-flash_{backend}.json").exists()
    with numba_attn.autotune():
        out = numba_attn.flash_forward(qd, kd, vd, causal=True, backend=backend)
    assert rel_error(out.get(), ref) <= TOLERANCE["float16"]
    assert len(timed) == len(module.TUNING_CANDIDATES)
    data = json.loads((tmp_path / f"autotune-flash_{backend}.json").read_text())
    assert len(data) == 1 and list(data.values())[0]["config"] in [
        dataclasses.asdict(c) for c in module.TUNING_CANDIDATES]
    with numba_attn.autotune():
        numba_attn.flash_forward(qd, kd, vd, causal=True, backend=backend)
    assert len(timed) == len(module.TUNING_CANDIDATES)  # remembered
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    for config in module.TUNING_CANDIDATES:
        out = cupy.full(q.shape, np.nan, np.float16)
        lse = cupy.full(q.shape[:3], np.nan, np.float32)
        module.launch(*(cuda.as_cuda_array(x) for x in (qd, kd, vd, out, lse)), True, 1 / np.sqrt(72), True,
                      cuda.default_stream(), config=config)
        cuda.default_stream().synchronize()
        assert rel_error(out.get(), ref) <= TOLERANCE["float16"], config
    tuner.forget()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mma", "wgmma"])
def test_gpu_flash_forward_in_a_cuda_graph_under_autotune_does_not_tune(monkeypatch, tmp_path, backend):
    """A forward call captured in a torch CUDA graph inside ``autotune()`` takes the shipped (or default)
    configuration: no timing, no synchronisation inside the capture; the replay is right."""
    torch = pytest.importorskip("torch")
    _skip_without(backend)
    tuner, module = _tuners_of(backend)
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(_autotune.ENABLE_ENV, raising=False)
    tuner.forget()
    timed = _count_timings(monkeypatch)
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 4, 300, 64)).astype(np.float16)).cuda() for _ in range(3))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        numba_attn.flash_forward(q, k, v, backend=backend)  # warm-up outside the capture (compiles the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with numba_attn.autotune(), torch.cuda.graph(graph, stream=stream):
        out = numba_attn.flash_forward(q, k, v, backend=backend)
    assert timed == []
    new = [rng.standard_normal((1, 4, 300, 64)).astype(np.float16) for _ in range(3)]
    for dst, src in zip((q, k, v), new):
        dst.copy_(torch.from_numpy(src))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out.float().cpu().numpy(), reference.attention(*new)) <= TOLERANCE["float16"]
    assert not (tmp_path / f"autotune-flash_{backend}.json").exists()
    tuner.forget()
