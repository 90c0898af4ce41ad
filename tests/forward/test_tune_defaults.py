"""``scripts/tune_defaults.py`` without a GPU: its plumbing (shapes, one tuning per key, the table it writes and
reads back, ``--merge``, ``--check``'s verdict) with a fake torch and a fake ``flash_forward`` whose candidates take
fixed times. The real timing runs on a GPU (the lead's command in docs/design/forward.md)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import types

import pytest

import numba_attn
from numba_attn.forward import dispatch
from numba_attn.runtime import autotune as _autotune

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "tune_defaults.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("tune_defaults", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeInputs:
    def __init__(self, torch, items):
        pass

    def get(self, dtype, d, shape):
        b, h, nq, nk = shape
        return types.SimpleNamespace(shape=(b, h, nq, d), dtype=dtype), types.SimpleNamespace(shape=(b, h, nk, d)), None


def fake_time(tuner, config, key, seqlen_q) -> float:
    """The default everywhere but at 16k keys, where the last candidate is twice as fast."""
    index = tuner.candidates.index(config)
    if key.sizes[1] == 16384 and index == len(tuner.candidates) - 1:
        return 0.5
    return 1.0 + 0.1 * index


@pytest.fixture
def fake_gpu(script, monkeypatch, tmp_path):
    calls = []

    def flash_forward(q, k, v, causal=False, backend=None):
        b, h, nq, d = q.shape
        key = dispatch.tuning_key(q.dtype, d, causal, b, h, nq, k.shape[2])
        tuner = dispatch.FLASH_MMA_TUNER if d > 128 else dispatch.FLASH_WGMMA_TUNER
        calls.append(key.text)
        return tuner.choose(key, lambda config: script.fake_time(tuner, config, key, nq), lambda: False)

    torch = types.SimpleNamespace(__version__="fake", cuda=types.SimpleNamespace(
        get_device_name=lambda: "fake GPU", synchronize=lambda: None))
    monkeypatch.setattr(script, "Inputs", FakeInputs)
    monkeypatch.setattr(script, "fake_time", fake_time, raising=False)
    monkeypatch.setattr(numba_attn, "flash_forward", flash_forward)
    monkeypatch.setattr(_autotune, "SIMULATOR", False)
    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path / "user"))
    yield torch, calls
    for tuner in dispatch.TUNERS:
        tuner.forget()


def options(tmp_path, **kwargs):
    values = dict(dtypes=["float16"], headdims=[64, 256], masks=["full", "causal"], backend=None, time_limit=1e9,
                  merge=False, take=None,
                  out=str(tmp_path / "sm00.json"), table=str(tmp_path / "sm00.json"), tolerance=5.0, report=None)
    values.update(kwargs)
    return argparse.Namespace(**values)


def test_tuning_writes_a_valid_table_one_key_at_a_time(script, fake_gpu, tmp_path, capsys):
    torch, calls = fake_gpu
    args = options(tmp_path)
    script.run_tune(args, torch, "sm00")
    table = json.loads((tmp_path / "sm00.json").read_text())
    assert table["family"] == "sm00" and table["source"]["device"] == "fake GPU"
    wgmma, mma = table["tuners"]["flash_wgmma"]["entries"], table["tuners"]["flash_mma"]["entries"]
    per_head_dim = 2 * 7  # causal or not x (3 B4 + 3 B1 size classes + the chunk)
    shapes_per_head_dim = 2 * 13  # causal or not x (6 B4 + 6 B1 + the chunk): every shape tunes
    assert len(wgmma) == len(mma) == per_head_dim and len(calls) == 2 * shapes_per_head_dim
    for text, entry in wgmma.items():
        fast = text.endswith("|16384")
        config = dispatch.FLASH_WGMMA_TUNER.candidates[-1 if fast else 0]
        assert entry["config"] == dataclasses.asdict(config), text
        assert entry["default_over_chosen"] == (2.0 if fast else 1.0)
        assert entry["worst_loss_pct"] == 0.0
        assert len(entry["timings_ms"]) == len(entry["shapes"])
        assert all(len(t) == len(dispatch.FLASH_WGMMA_TUNER.candidates) for t in entry["timings_ms"])
    assert wgmma["float16|64|False|262144|1024"]["shapes"] == [[4, 48, 512, 512, 64], [4, 48, 1024, 1024, 64]]
    for tuner in dispatch.TUNERS:
        assert _autotune.TunedTable.read(args.out, tuner)[1] == []
    out = capsys.readouterr().out
    assert "worst loss  0.0 % (default 100.0 %)" in out and "worst loss  0.0 % (default  0.0 %)" in out
    assert not os.path.exists(tmp_path / "user")  # the user's cache is not touched


def test_a_key_shared_by_shapes_takes_the_smallest_worst_loss(script, fake_gpu, tmp_path, monkeypatch):
    """At 512 rows the second candidate is fastest (0.8 against 1.0), elsewhere the first (1.0 against 1.1): where
    512 shares a key with 1k, the first loses 25 % at 512, the second 10 % at 1k -- the second is written."""
    torch, _ = fake_gpu

    def conflicting(tuner, config, key, seqlen_q):
        index = tuner.candidates.index(config)
        return (0.8 if index == 1 else 1.0 + 0.1 * index) if seqlen_q == 512 else 1.0 + 0.1 * index

    monkeypatch.setattr(script, "fake_time", conflicting)
    script.run_tune(options(tmp_path, headdims=[64]), torch, "sm00")
    wgmma = json.loads((tmp_path / "sm00.json").read_text())["tuners"]["flash_wgmma"]["entries"]
    shared = wgmma["float16|64|False|262144|1024"]  # B4 at 512 and 1k
    assert shared["config"] == dataclasses.asdict(dispatch.FLASH_WGMMA_TUNER.candidates[1])
    assert shared["worst_loss_pct"] == 10.0
    alone = wgmma["float16|64|False|65536|16384"]  # the chunk: 1k rows, its own key
    assert alone["config"] == dataclasses.asdict(dispatch.FLASH_WGMMA_TUNER.candidates[0])


def test_merge_keeps_the_keys_a_run_does_not_tune(script, fake_gpu, tmp_path):
    torch, _ = fake_gpu
    script.run_tune(options(tmp_path, headdims=[256]), torch, "sm00")
    for tuner in dispatch.TUNERS:
        tuner.forget()
    script.run_tune(options(tmp_path, headdims=[64], merge=True), torch, "sm00")
    table = json.loads((tmp_path / "sm00.json").read_text())
    assert len(table["tuners"]["flash_mma"]["entries"]) == len(table["tuners"]["flash_wgmma"]["entries"]) == 14
    assert len(table["merged_from"]) == 1


def test_masks_choose_the_keys_a_run_tunes(script, fake_gpu, tmp_path):
    torch, _ = fake_gpu
    script.run_tune(options(tmp_path, headdims=[64], masks=["causal"]), torch, "sm00")
    entries = json.loads((tmp_path / "sm00.json").read_text())["tuners"]["flash_wgmma"]["entries"]
    assert entries and all(key.split("|")[2] == "True" for key in entries)  # (dtype|d|causal|rows|keys)


def test_take_writes_only_the_keys_that_chose_those_fields(script, fake_gpu, tmp_path, monkeypatch):
    """A first run chooses the first candidate everywhere; a second prefers the second, and the last at 16k keys:
    with ``take`` naming the last one's fields only the 16k keys change, the rest keep the first run's."""
    torch, _ = fake_gpu
    tuner = dispatch.FLASH_MMA_TUNER  # (head dim 256: three candidates)
    first, second, last = tuner.candidates[0], tuner.candidates[1], tuner.candidates[-1]
    monkeypatch.setattr(script, "fake_time", lambda tuner_, config, key, seqlen_q: 1 + tuner_.candidates.index(config))
    script.run_tune(options(tmp_path, headdims=[256]), torch, "sm00")
    for t in dispatch.TUNERS:
        t.forget()

    def prefers_second(tuner_, config, key, seqlen_q):
        index = tuner_.candidates.index(config)
        if key.sizes[1] == 16384 and index == len(tuner_.candidates) - 1:
            return 0.5
        return 0.9 if index == 1 else 1.0 + 0.1 * index

    monkeypatch.setattr(script, "fake_time", prefers_second)
    take = ",".join(f"{name}={value}" for name, value in dataclasses.asdict(last).items())
    script.run_tune(options(tmp_path, headdims=[256], merge=True, take=take), torch, "sm00")
    table = json.loads((tmp_path / "sm00.json").read_text())
    entries = table["tuners"]["flash_mma"]["entries"]
    assert len(entries) == 14 and len({first, second, last}) == 3
    for text, entry in entries.items():
        wanted = last if text.endswith("|16384") else first
        assert entry["config"] == dataclasses.asdict(wanted), text
    taken = sorted(text for text in entries if text.endswith("|16384"))
    assert table["source"]["taken"].endswith(", ".join(taken)) and len(taken) == 6
    with pytest.raises(SystemExit, match="no field nonsense"):
        script.takes("nonsense=1", dataclasses.asdict(first))
    with pytest.raises(SystemExit, match="name=value"):
        script.parse_fields("block_n")


def test_take_leaves_the_keys_of_tuners_without_those_fields(script, fake_gpu, tmp_path, monkeypatch):
    """A run over two kernels' keys (head dims 64 and 256: the wgmma and mma tuners) with ``take`` naming fields
    of the mma kernel's configurations only: its keys are taken where they chose them, the wgmma keys keep the first
    run's entries (2026-11-27: the run stopped at the wgmma keys instead, and wrote nothing)."""
    torch, _ = fake_gpu
    mma, wgmma = dispatch.FLASH_MMA_TUNER, dispatch.FLASH_WGMMA_TUNER
    monkeypatch.setattr(script, "fake_time", lambda tuner_, config, key, seqlen_q: 1 + tuner_.candidates.index(config))
    script.run_tune(options(tmp_path, headdims=[64, 256]), torch, "sm00")
    for t in dispatch.TUNERS:
        t.forget()
    monkeypatch.setattr(script, "fake_time", lambda tuner_, config, key, seqlen_q: 1.0 / (1 + tuner_.candidates.index(
        config)))  # (the last candidate everywhere)
    take = ",".join(f"{name}={value}" for name, value in dataclasses.asdict(mma.candidates[-1]).items())
    script.run_tune(options(tmp_path, headdims=[64, 256], merge=True, take=take), torch, "sm00")
    table = json.loads((tmp_path / "sm00.json").read_text())
    assert table["tuners"]["flash_wgmma"]["entries"] and all(
        entry["config"] == dataclasses.asdict(wgmma.candidates[0])
        for entry in table["tuners"]["flash_wgmma"]["entries"].values())
    assert all(entry["config"] == dataclasses.asdict(mma.candidates[-1])
               for entry in table["tuners"]["flash_mma"]["entries"].values())


def test_time_limit_stops_new_shapes(script, fake_gpu, tmp_path, capsys):
    torch, calls = fake_gpu
    script.run_tune(options(tmp_path, time_limit=-1.0), torch, "sm00")
    assert calls == [] and "52 shapes not tuned" in capsys.readouterr().out


def test_check_passes_on_the_table_of_the_same_times_and_fails_on_a_worse_one(script, fake_gpu, tmp_path, capsys):
    torch, calls = fake_gpu
    script.run_tune(options(tmp_path), torch, "sm00")
    report = tmp_path / "check.json"
    assert script.run_check(options(tmp_path, report=str(report)), torch, "sm00") == 0
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == 2 * 2 * (6 + 6 + 1 + 2)
    assert all(row["shipped_loss_pct"] == 0.0 for row in rows)
    assert sum(not row["exact_entry"] for row in rows) == 2 * 2 * 2  # the two nearest-entry shapes
    assert max(row["default_loss_pct"] for row in rows) == 100.0
    # a table that keeps the default at 16k keys loses 100 % there
    path = tmp_path / "sm00.json"
    table = json.loads(path.read_text())
    for entry in table["tuners"]["flash_wgmma"]["entries"].values():
        entry["config"] = table["tuners"]["flash_wgmma"]["default"]
    path.write_text(json.dumps(table))
    capsys.readouterr()
    assert script.run_check(options(tmp_path), torch, "sm00") == 1
    assert "OVER" in capsys.readouterr().out


def test_each_shape_shares_the_callers_compiled_kernels(script, tmp_path, monkeypatch):
    """A shape's fresh tuning cache links the caller's kernels folder (kernels compiled before, e.g. by
    ``scripts/prewarm_ws.py``, load from disk); without one there is nothing to link."""
    from numba_attn.runtime import kernel_cache

    kernels = tmp_path / "user" / "kernels"
    monkeypatch.setenv(_autotune.CACHE_DIR_ENV, str(tmp_path / "user"))
    script.fresh_cache(str(tmp_path / "tune"), 0, str(kernels))  # (no folder yet)
    assert not os.path.exists(kernel_cache.kernels_dir())
    kernels.mkdir(parents=True)
    script.fresh_cache(str(tmp_path / "tune"), 1, str(kernels))
    assert os.path.samefile(kernel_cache.kernels_dir(), kernels)
    assert _autotune.cache_dir() == str(tmp_path / "tune" / "1")
    for tuner in dispatch.TUNERS:
        tuner.forget()


def test_prewarm_lists_every_usable_candidate():
    spec = importlib.util.spec_from_file_location(
        "prewarm_ws", os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "prewarm_ws.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from numba_attn.forward import wgmma_ws

    found = module.specs(["64:float16,bfloat16", "128:bfloat16"], extra=[("x",)])
    usable = {d: sum(wgmma_ws.usable(c, d) for c in wgmma_ws.TUNING_CANDIDATES) for d in (64, 128)}
    assert len(found) == 2 * 2 * usable[64] + 2 * usable[128] + 1 and found[-1] == ("x",)
    assert {(d, dtype, causal) for _, d, dtype, causal, _ in found[:-1]} == {
        (64, "float16", False), (64, "float16", True), (64, "bfloat16", False), (64, "bfloat16", True),
        (128, "bfloat16", False), (128, "bfloat16", True)}
    fp8 = module.specs(["128:fp8"])
    from numba_attn.forward import wgmma_ws_fp8

    configs = {tuple(sorted(fields.items())) for fields, *_ in fp8}
    assert len(fp8) == 2 * len(configs) and {dtype for _, _, dtype, _, _ in fp8} == {"fp8"}
    for base in wgmma_ws_fp8.TUNING_CANDIDATES:  # each candidate and its persistent form
        for persistent in {base.persistent, True}:
            fields = dataclasses.asdict(dataclasses.replace(base, persistent=persistent))
            assert tuple(sorted(fields.items())) in configs
