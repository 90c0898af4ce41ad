"""The benchmark sweep (scripts/sweep.py, the scripts/bench package) end to end on a tiny grid, plus its helpers.

The run uses tiny explicit shapes so that it takes seconds under Numba's CUDA simulator (and also works on a GPU,
with torch arrays and CUDA-event timing). Two extra providers are injected through the registry: one that returns a
wrong answer (must be marked FAIL and never timed) and one that raises (must be recorded as skipped with the
error text, without stopping the sweep). The real-batch sweeps (varlen, paged, window) run the same way at tiny
sizes, each with an injected provider that makes the mistake its check is there to catch.
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


# --------------------------------------------------------------------------------------------------------------------
# The real-batch sweeps (varlen, paged, window)
# --------------------------------------------------------------------------------------------------------------------
BATCHES = [
    "--sweeps", "varlen,paged,window",
    "--seqlens", "16",
    "--flash-configs", "16:1",
    "--batch", "1",
    "--varlen-seqs", "2",  # lengths 8 and 24
    "--window", "4",
    "--decode-lengths", "32",
    "--decode-heads", "2",
    "--decode-kv-heads", "1",
    "--decode-headdim", "16",
    "--page-sizes", "16,64",  # 64 does not divide 32 keys: skipped with the reason
    "--paged-rows", "both",
    "--dtypes", "fp32",
    "--reps", "1",
    "--warmup", "0",
    "--budget", "0.2",
    "--no-plot",
    # numba_attn's providers and the injected wrong ones; the torch peers are not the test's business on a GPU
    "--providers", "numba_attn,poisoned",
]


def _poisoned_providers(bench):
    """A plausible mistake per real-batch sweep that the check must catch: attention across the packed sequences
    (varlen: the last sequence sees the others' keys), every cached key read whatever ``cache_seqlens`` says (paged:
    wrong for ragged rows only), no window (window). float64 NumPy, from the inputs wherever they live."""
    import reference
    from bench.environment import to_numpy

    def provider(compute):
        def prepare(case, inputs, env):
            x = {name: to_numpy(a) for name, a in inputs.items()}
            return bench.providers.Prepared(lambda: compute(case, x))

        return bench.providers.Provider(prepare, note="deliberately wrong")

    def across_sequences(case, x):
        q, k, v = (x[n].transpose(1, 0, 2)[None] for n in ("q", "k", "v"))  # all tokens as one sequence
        return reference.attention(q, k, v, causal=case.causal)[0].transpose(1, 0, 2)

    return {"varlen": {"poisoned": provider(across_sequences)},
            "paged": {"poisoned": provider(lambda case, x: reference.attention(x["q"], x["k"], x["v"]))},
            "window": {"poisoned": provider(lambda case, x: reference.attention(x["q"], x["k"], x["v"], causal=True))}}


@pytest.fixture(scope="module")
def batch_run(sweep, bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_batches")
    result = sweep.main(BATCHES + ["--out", str(out)], extra_providers=_poisoned_providers(bench))
    return {"rows": result["rows"], "meta": result["meta"], "out": out}


def _by(rows, sweep_name, provider):
    return [r for r in rows if r["sweep"] == sweep_name and r["provider"] == provider]


def test_batch_sweeps_check_and_time_numba_attn(batch_run):
    rows = batch_run["rows"]
    expected = {"varlen": ["numba_attn"], "paged": ["numba_attn", "numba_attn[paged16]"],
                "window": ["numba_attn", "numba_attn[causal]"]}
    counts = {"varlen": 2, "paged": 2, "window": 1}  # causal and not; full and ragged rows; N=16 > W=4
    for sweep_name, providers in expected.items():
        for name in providers:
            mine = _by(rows, sweep_name, name)
            assert len(mine) == counts[sweep_name], (sweep_name, name)
            for r in mine:
                assert r["status"] == "ok", r
                assert np.isfinite(r["rel_err"]) and r["rel_err"] <= r["tol"], r
                assert r["ms"] > 0 and r["reps"] >= 1, r
    for r in _by(rows, "paged", "numba_attn[paged64]"):
        assert r["status"] == "skip" and "not a multiple of the page size 64" in r["reason"]
    if batch_run["meta"]["simulator"]:  # the torch peers are named as not run, with the reason
        reason = batch_run["meta"]["unavailable_peers"]["GPU peers"]
        assert "simulator" in reason and "torch-flex" in reason and "torch-nested" in reason


def test_batch_sweeps_count_their_work(batch_run):
    rows = batch_run["rows"]
    for r in _by(rows, "varlen", "numba_attn"):  # 4 * H * D * (8^2 + 24^2), halved for causal
        assert sorted(int(n) for n in r["lengths"].split(",")) == [8, 24]
        assert r["flops"] == 4 * 16 * (8 * 8 + 24 * 24) * (0.5 if r["causal"] else 1.0)
    (window,), (full,) = _by(rows, "window", "numba_attn"), _by(rows, "window", "numba_attn[causal]")
    pairs = sum(min(i, 4) + 1 for i in range(16))
    assert window["flops"] == 4 * 16 * pairs and full["flops"] == 2 * 16 * 16 * 16
    assert window["vs_baseline"] == pytest.approx(window["tflops"] / full["tflops"])
    ragged = [r for r in _by(rows, "paged", "numba_attn[paged16]") if r["config"].endswith("ragged")]
    assert len(ragged) == 1 and ragged[0]["bytes"] == 4 * (2 * 16 * 16 + 2 * 2 * 16)  # row 0 holds 16 of 32 keys
    dense = {r["config"]: r for r in _by(rows, "paged", "numba_attn")}
    for r in _by(rows, "paged", "numba_attn[paged16]"):
        assert r["vs_baseline"] == pytest.approx(r["gbs"] / dense[r["config"]]["gbs"])
    md = open(os.path.join(batch_run["out"], "results.md")).read()
    for text in ("## varlen", "## paged", "## window", "numba_attn[paged16] / numba_attn rate",
                 "numba_attn / numba_attn[causal] rate"):
        assert text in md


def test_batch_sweeps_catch_wrong_outputs(batch_run):
    """The checks read the rows a mistake shows in: the last packed sequence, a short ragged row, the window."""
    rows = batch_run["rows"]
    for sweep_name in ("varlen", "paged", "window"):
        for r in _by(rows, sweep_name, "poisoned"):
            wrong = sweep_name != "paged" or r["config"].endswith("ragged")
            if wrong:
                assert r["status"] == "FAIL" and r["rel_err"] > r["tol"], r
                assert r["ms"] is None and r["reps"] == 0, r  # never timed
            else:  # every row full: reading the whole cache is right
                assert r["status"] == "ok", r
    assert len([r for r in rows if r["provider"] == "poisoned" and r["status"] == "FAIL"]) == 4


def test_batch_layouts(bench):
    layouts = importlib.import_module("bench.layouts")
    lengths = layouts.mixed_lengths(1024, 16)
    assert sorted(lengths) == [64 * (2 * i + 1) for i in range(16)] and sum(lengths) == 16 * 1024
    assert list(lengths) != sorted(lengths)  # shuffled
    assert layouts.cu_seqlens([3, 5]).tolist() == [0, 3, 8]
    assert layouts.ragged_lengths(64, 4) == (32, 40, 48, 56)
    for n, w in ((16, 4), (8, 8), (5, 0), (100, 7)):
        assert layouts.window_pairs(n, w) == sum(min(i, w) + 1 for i in range(n))
    env = importlib.import_module("bench.environment").Env(simulator=True)
    k, v = (np.random.default_rng(i).standard_normal((2, 3, 64, 4)) for i in range(2))
    k_pool, v_pool, table = layouts.paged_cache(env, k, v, 16, seed=1)
    assert k_pool.shape == (8, 16, 3, 4) and table.shape == (2, 4) and table.dtype == np.int32
    assert table.ravel().tolist() != list(range(8))  # pages out of order
    for b in range(2):
        for p in range(4):
            assert np.array_equal(k_pool[table[b, p]], k[b, :, 16 * p:16 * (p + 1)].transpose(1, 0, 2))
            assert np.array_equal(v_pool[table[b, p]], v[b, :, 16 * p:16 * (p + 1)].transpose(1, 0, 2))


def test_batch_options_presets_and_validation(bench):
    parse = bench.cli.build_parser().parse_args
    sim = bench.cli.resolve_options(parse([]), simulator=True)
    assert (sim.varlen_seqs, sim.window, sim.page_sizes, sim.paged_rows) == (2, 8, [16], ["ragged"])
    full = bench.cli.resolve_options(parse(["--sweeps", "varlen,paged,window", "--window", "2k"]), simulator=False)
    assert full.sweeps == ["varlen", "paged", "window"] and full.window == 2048
    assert (full.varlen_seqs, full.page_sizes, full.paged_rows) == (16, [16, 64, 256], ["full", "ragged"])
    assert "paged" in full.graph_sweeps
    assert bench.cli.resolve_options(parse(["--quick"]), simulator=False).window == 1024
    assert bench.cli.resolve_options(parse(["--paged-rows", "full"]), simulator=True).paged_rows == ["full"]
    for bad in (["--varlen-seqs", "0"], ["--window", "0"], ["--page-sizes", "16,0"], ["--paged-rows", "some"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_batch_peers_skip_cleanly_without_torch_tensors(bench):
    """FlexAttention and nested-tensor SDPA: unavailable with the reason when torch (or the feature) is missing,
    otherwise providers that skip non-torch arrays with the reason."""
    peers = importlib.import_module("bench.peers")
    env = importlib.import_module("bench.environment").Env(simulator=True)
    opts = bench.cli.resolve_options(bench.cli.build_parser().parse_args([]), simulator=True)
    case = next(bench.cases.varlen_cases(opts))
    for name, sweeps in (("torch_flex", {"varlen", "window"}), ("torch_nested", {"varlen"})):
        module, reason = peers.load(name)
        if module is None:
            assert reason, name
            continue
        groups = module.providers(opts)
        assert set(groups) == sweeps
        for provider in groups["varlen"].values():
            assert "needs torch tensors" in provider.check(case, env)


def test_flex_masks_match_the_reference():
    """The FlexAttention peer's masks and packed layout, eagerly on the CPU (the sweep compiles them on a GPU)."""
    pytest.importorskip("torch")
    import warnings

    import reference
    import torch

    from bench.layouts import cu_seqlens, mixed_lengths
    from bench.peers import torch_flex

    lengths = mixed_lengths(16, 3)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 16, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (flex_attention warns that it is not compiled)
        for causal in (False, True):
            mask = torch_flex.block_mask(torch_flex.document_mask(lengths, causal, "cpu"), total, "cpu", compile=False)
            fn, post = torch_flex.packed(q, k, v, mask, compile=False)
            ref = reference.attention_varlen(q.numpy(), k.numpy(), v.numpy(), cu_seqlens(lengths),
                                             cu_seqlens(lengths), causal=causal)
            np.testing.assert_allclose(post(fn()).numpy(), ref, rtol=1e-9, atol=1e-9)
        q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(3))
        mask = torch_flex.block_mask(torch_flex.sliding_window_mask(8), 40, "cpu", compile=False)
        out = torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=mask)
        ref = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, window=(8, 0))
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-9, atol=1e-9)


def test_baseline_ratio_columns(bench):
    """A baseline provider (paged: the dense cache) gets no best-peer columns where the table has no peer, and each
    other numba_attn provider its rate over the baseline's."""
    case = bench.cases.Case("paged", "H=2 Hkv=1 D=16", "float16", 4096, 1, 2, 1, 1, 4096, 16, 16, nbytes=1e9)
    dense = bench.providers.Provider(lambda *a: None, ours=True, baseline=True)
    paged = bench.providers.Provider(lambda *a: None, ours=True)
    row = bench.runner._row
    rows = [row(case, "numba_attn", dense, status="ok", ms=1.0, gbs=1000.0),
            row(case, "numba_attn[paged16]", paged, status="ok", ms=1.25, gbs=800.0)]
    bench.report.add_comparisons(rows, copy_gbs=2000.0)
    assert rows[1]["vs_baseline"] == 0.8 and rows[0]["vs_baseline"] is None
    ((_, header, body),) = bench.report.pivot_tables(rows, "paged")
    assert header == ["size", "numba_attn", "numba_attn[paged16]", "numba_attn[paged16] / numba_attn rate"]
    assert body[0][1:] == ["1.000 / 1000.0 (50%)", "1.250 / 800.0 (40%)", "0.80x"]
