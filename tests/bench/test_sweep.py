"""The benchmark sweep (scripts/sweep.py, the scripts/bench package) end to end on a tiny grid, plus its helpers.

The run uses tiny explicit shapes so that it takes seconds under Numba's CUDA simulator (and also works on a GPU,
with torch arrays and CUDA-event timing). Two extra providers are injected through the registry: one that returns a
wrong answer (must be marked FAIL and never timed) and one that raises (must be recorded as skipped with the
error text, without stopping the sweep).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "sweep.py")

TINY = [
    "--sweeps", "flash,decode,linear",
    "--seqlens", "16,32",
    "--flash-configs", "16:1",
    "--batch", "1",
    "--decode-lengths", "32,64",
    "--decode-heads", "2",
    "--decode-kv-heads", "2,1",
    "--decode-headdim", "16",
    "--linear-heads", "1",
    "--linear-dim", "16",
    "--dtypes", "fp32",
    "--reps", "2",
    "--warmup", "0",
    "--budget", "0.5",
    "--no-plot",
    # numba_attn, the simulator's NumPy peer and the two injected providers; on a GPU the real peers are left out
    # (they are the sweep's business, not this test's, and compiling them would make the test slow)
    "--providers", "numba_attn,numpy-naive,wrong,raises",
]


def _load_sweep():
    spec = importlib.util.spec_from_file_location("sweep_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep():
    """The entry point, scripts/sweep.py (it puts scripts/ on sys.path for the bench package)."""
    return _load_sweep()


@pytest.fixture(scope="module")
def bench(sweep):
    """The modules of the bench package that sweep.py runs, by name (bench.cli, bench.cases, ...)."""
    names = ("cases", "cli", "providers", "report", "runner")
    return types.SimpleNamespace(**{n: importlib.import_module(f"bench.{n}") for n in names})


class _Counter:
    def __init__(self):
        self.calls = 0


def _wrong_provider(bench, counter):
    """Returns ones of the right shape: rel err ~1, far above any bound."""

    def prepare(case, inputs, env):
        def fn():
            counter.calls += 1
            return np.ones(case.out_shape(), dtype=case.dtype)

        return bench.providers.Prepared(fn)

    return bench.providers.Provider(prepare, note="deliberately wrong")


def _raising_provider(bench):
    def prepare(case, inputs, env):
        def fn():
            raise RuntimeError("boom: this provider does not support anything")

        return bench.providers.Prepared(fn)

    return bench.providers.Provider(prepare, note="always raises")


@pytest.fixture(scope="module")
def run(sweep, bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    counter = _Counter()
    extra = {s: {"wrong": _wrong_provider(bench, counter), "raises": _raising_provider(bench)}
             for s in bench.cases.SWEEPS}
    result = sweep.main(TINY + ["--out", str(out)], extra_providers=extra)
    return {"result": result, "out": out, "wrong_calls": counter.calls}


def _csv_rows(out):
    with open(os.path.join(out, "results.csv")) as f:
        return list(csv.DictReader(f))


EXPECTED_CASES = {
    "flash": [(c, s) for c in ("D=16 H=1 non-causal", "D=16 H=1 causal") for s in (16, 32)],
    "decode": [(c, s) for c in ("H=2 Hkv=2 D=16", "H=2 Hkv=1 D=16 (GQA 2)") for s in (32, 64)],
    "linear": [("H=1 E=M=16", s) for s in (16, 32)],
}


def test_files_written(run):
    names = sorted(os.listdir(run["out"]))
    assert {"results.csv", "results.json", "results.md"} <= set(names)
    assert len(names) <= 8
    assert not any(n.endswith(".png") for n in names)  # --no-plot


def test_a_row_per_provider_and_case(run):
    rows = _csv_rows(run["out"])
    meta = run["result"]["meta"]
    for sweep_name, cases in EXPECTED_CASES.items():
        providers = list(meta["providers"][sweep_name])
        assert "numba_attn" in providers and "wrong" in providers and "raises" in providers
        for config, size in cases:
            got = [r["provider"] for r in rows
                   if r["sweep"] == sweep_name and r["config"] == config and int(r["size"]) == size]
            assert sorted(got) == sorted(providers), (sweep_name, config, size)


def test_correct_providers_are_within_bounds_and_timed(run):
    rows = _csv_rows(run["out"])
    for r in rows:
        if r["status"] == "ok":
            assert float(r["rel_err"]) <= float(r["tol"]), r
            assert float(r["ms"]) > 0 and int(r["reps"]) >= 1, r
    ours_flash = [r for r in rows if r["provider"] == "numba_attn" and r["sweep"] == "flash"]
    assert ours_flash and all(r["status"] == "ok" for r in ours_flash)
    # decode and linear kernels: correct when present; a kernel that raises is recorded, not fatal
    for r in rows:
        if r["provider"] == "numba_attn":
            assert r["status"] in ("ok", "skip"), r
            assert r["status"] == "ok" or r["reason"], r
    for r in rows:
        if r["provider"] not in ("wrong", "raises"):
            assert r["status"] != "FAIL", r


def test_wrong_provider_fails_and_is_not_timed(run):
    rows = [r for r in _csv_rows(run["out"]) if r["provider"] == "wrong"]
    n_cases = sum(len(c) for c in EXPECTED_CASES.values())
    assert len(rows) == n_cases
    for r in rows:
        assert r["status"] == "FAIL"
        assert float(r["rel_err"]) > float(r["tol"])
        assert r["ms"] == "" and r["reps"] == "0"
    assert run["wrong_calls"] == n_cases  # exactly the correctness call, never a timed one


def test_raising_provider_is_skipped_with_reason(run):
    rows = [r for r in _csv_rows(run["out"]) if r["provider"] == "raises"]
    assert rows and all(r["status"] == "skip" and "boom" in r["reason"] for r in rows)


def test_json_and_markdown(run):
    with open(os.path.join(run["out"], "results.json")) as f:
        data = json.load(f)
    meta = data["meta"]
    for key in ("device", "date", "versions", "command", "simulator", "options"):
        assert key in meta
    assert "numba" in meta["versions"] and "numpy" in meta["versions"]
    assert "--seqlens" in meta["command"]
    assert len(data["results"]) == len(_csv_rows(run["out"]))
    md = open(os.path.join(run["out"], "results.md")).read()
    for heading in ("## flash", "## decode", "## linear"):
        assert heading in md
    assert "| size |" in md and "FAIL" in md and "halved for causal" in md


def test_plot_written_when_matplotlib_is_present(bench, run, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "flash.png"
    problem = bench.report.write_plot(str(path), run["result"]["rows"], "flash", run["result"]["meta"])
    assert problem is None and path.stat().st_size > 0


def test_provider_filter_and_helpers(bench):
    assert bench.cli.parse_size("4k") == 4096 and bench.cli.parse_size("48") == 48
    assert bench.cases.size_label(16384) == "16k" and bench.cases.size_label(48) == "48"
    tol = bench.cli._tolerances("fp16=3e-3,tf32=1e-2")
    assert tol == {"fp16": 3e-3, "tf32": 1e-2}
    registry = {"flash": {"numba_attn": 1, "torch-sdpa-flash": 2, "triton-fa2": 3}}
    keep = bench.providers.filter_registry
    assert list(keep(registry, ["numba", "triton"])["flash"]) == ["numba_attn", "triton-fa2"]
    registry["flash"]["numba_attn[mma]"] = 4
    assert list(keep(registry, ["=numba_attn", "flash"])["flash"]) == ["numba_attn", "torch-sdpa-flash"]


def test_backend_keyword_adds_providers(bench):
    def with_backend(q, k, v, *, causal=False, backend=None):
        return q

    def without_backend(q, k, v, *, causal=False):
        return q

    assert bench.providers._backend_variants(without_backend, ("simt", "mma")) == [None]
    assert bench.providers._backend_variants(with_backend, ("simt", "mma")) == [None, "simt", "mma"]


def test_linear_providers_cover_both_backends_and_tf32(bench):
    names = set(bench.providers.numba_attn_providers("linear"))
    assert {"numba_attn", "numba_attn[chunked]", "numba_attn[recurrent]", "numba_attn[tf32]"} <= names


def test_help_documents_options(bench):
    text = bench.cli.build_parser().format_help()
    for option in ("--sweeps", "--seqlens", "--dtypes", "--providers", "--batch", "--headdims", "--heads",
                   "--decode-lengths", "--reps", "--out", "--quick", "--no-plot", "--tol"):
        assert option in text


def test_graph_times_get_their_own_tables_and_ratios(bench):
    """CUDA graph times (decode on a GPU) are compared and tabulated apart from the queued times."""
    case = bench.cases.Case("decode", "H=2 Hkv=1 D=16", "float16", 4096, 1, 2, 1, 1, 4096, 16, 16, nbytes=1e9)
    ours = bench.providers.Provider(lambda *a: None, ours=True)
    peer = bench.providers.Provider(lambda *a: None)
    row = bench.runner._row
    rows = [row(case, "numba_attn", ours, status="ok", ms=2.0, graph_ms=1.0, gbs=500.0, graph_gbs=1000.0),
            row(case, "peer", peer, status="ok", ms=1.0, graph_ms=2.0, gbs=1000.0, graph_gbs=500.0)]
    bench.report.add_comparisons(rows, copy_gbs=2000.0)
    assert rows[0]["vs_best_peer"] == 2.0 and rows[0]["graph_vs_best_peer"] == 0.5
    assert rows[0]["graph_pct_copy_bw"] == 50.0 and rows[1]["pct_copy_bw"] == 50.0
    tables = bench.report.pivot_tables(rows, "decode")
    assert [title.endswith("(CUDA graph replays)") for title, _, _ in tables] == [False, True]
    (_, _, queued), (_, _, graph) = tables
    assert queued[0][1:4] == ["2.000 / 500.0 (25%)", "1.000 / 1000.0 (50%)", "2.00x"]
    assert graph[0][1:4] == ["1.000 / 1000.0 (50%)", "2.000 / 500.0 (25%)", "0.50x"]
    for r in rows:
        r["graph_ms"] = r["graph_gbs"] = None
    assert len(bench.report.pivot_tables(rows, "decode")) == 1


def test_backward_direction(sweep, tmp_path):
    """``--direction backward`` turns the flash sweep into ``flash_bwd``: flash_backward timed, dq checked against
    the reference, FLOPs 2.5 times the forward's."""
    args = ["--sweeps", "flash", "--direction", "backward", "--seqlens", "16", "--flash-configs", "16:1", "--batch",
            "1", "--dtypes", "fp32", "--causal", "causal", "--reps", "1", "--warmup", "0", "--budget", "0.2",
            "--no-plot", "--providers", "=numba_attn", "--out", str(tmp_path)]
    rows = sweep.main(args)["rows"]
    assert [(r["sweep"], r["provider"], r["status"]) for r in rows] == [("flash_bwd", "numba_attn", "ok")]
    assert rows[0]["flops"] == 2.5 * 4 * 16 * 16 * 16 * 0.5
    assert rows[0]["rel_err"] <= rows[0]["tol"]


def test_gradient_directions(sweep, tmp_path):
    """``--direction backward,fwdbwd`` on flash and linear: the backward alone and forward + backward in one call,
    ``dq`` checked against the float64 reference; flash FLOPs 2.5 and 3.5 times the forward's."""
    args = ["--sweeps", "flash,linear", "--direction", "backward,fwdbwd", "--seqlens", "16", "--flash-configs",
            "16:1", "--batch", "1", "--linear-heads", "1", "--linear-dim", "16", "--dtypes", "fp32", "--causal",
            "causal", "--reps", "1", "--warmup", "0", "--budget", "0.2", "--no-plot", "--providers", "=numba_attn",
            "--out", str(tmp_path)]
    rows = sweep.main(args)["rows"]
    assert [(r["sweep"], r["status"]) for r in rows] == [
        ("flash_bwd", "ok"), ("flash_fwdbwd", "ok"), ("linear_bwd", "ok"), ("linear_fwdbwd", "ok")]
    flops = {r["sweep"]: r["flops"] for r in rows}
    assert flops["flash_bwd"] == 2.5 * 4 * 16 * 16 * 16 * 0.5 and flops["flash_fwdbwd"] == 3.5 * 4 * 16 * 16 * 16 * 0.5
    assert all(r["rel_err"] <= r["tol"] for r in rows)


@pytest.mark.parametrize("text", ["sideways", "forward,up", ""])
def test_direction_rejects_unknown_names(sweep, text):
    with pytest.raises(SystemExit):
        sweep.main(["--direction", text, "--no-plot", "--out", "/nonexistent-never-written"])
