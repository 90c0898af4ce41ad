#!/usr/bin/env bash
# GPU check of the on-disk kernel cache (runtime/kernel_cache.py, issue #27), from the repo root, one GPU, ~3 min:
#   bash scripts/gpu_check_kcache.sh [OUTDIR]
# 1. tests/runtime/test_kernel_cache.py (its gpu tests compile small kernels in child processes and reload them);
# 2. the first call of each public function, each in a fresh process (torch fp16 inputs; NUMBA_ATTN_AUTOTUNE=0),
#    with an empty cache folder, then with the warm one (target: <= 1.0 s warm, the call including kernel loads;
#    the import is printed apart), then all five in one warm process; a warm call over 1 s is profiled to OUTDIR.
#    (Cold: the folder starts empty and each process adds its kernels, so a later function may load a kernel an
#    earlier one shares, such as the linear functions' prefix kernel.)
# 3. results against `reference` at small sizes in fresh warm processes (twice: the second must load every
#    kernel from disk), and once more through Numba's own launch (NUMBA_ATTN_FAST_LAUNCH=0).
# Exit status 0 only if every part passed.
set -uo pipefail
out=${1:-kcache_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then  # as scripts/gpu_check.sh: wheels for machines without a package index
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_ATTN_AUTOTUNE=0
unset NUMBA_ENABLE_CUDASIM NUMBA_ATTN_KERNEL_CACHE NUMBA_ATTN_FAST_LAUNCH
work=$(mktemp -d)
cache="$work/cache"
probe="$work/kcache_probe.py"
cat > "$probe" <<'PY'
"""time FN PHASE | all | check: see scripts/gpu_check_kcache.sh."""
import json, os, sys, time

t0 = time.perf_counter()
import numba_attn  # noqa: E402
import_s = time.perf_counter() - t0
import numpy as np  # noqa: E402
import torch  # noqa: E402

from numba_attn.runtime import kernel_cache  # noqa: E402

FUNCTIONS = ("flash_forward", "flash_decode", "causal_dot_product", "linear_attention", "combine_lse")


def sync():
    torch.cuda.synchronize()


def randn(shape, seed, dtype=torch.float16, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", dtype=torch.float32, generator=g) * scale).to(dtype)


def big_call(fn):
    """The timed call: flash_forward fp16 B4 H16 N4k D128 causal, and calls of the same scale for the others."""
    if fn == "flash_forward":
        q, k, v = (randn((4, 16, 4096, 128), s) for s in range(3))
        return lambda: numba_attn.flash_forward(q, k, v, causal=True)
    if fn == "flash_decode":
        q, k, v = randn((4, 32, 1, 128), 0), randn((4, 8, 8192, 128), 1), randn((4, 8, 8192, 128), 2)
        return lambda: numba_attn.flash_decode(q, k, v)
    if fn in ("causal_dot_product", "linear_attention"):
        q, k, v = (randn((4, 8, 4096, 64), s, scale=0.25) for s in range(3))
        return lambda: getattr(numba_attn, fn)(q, k, v)
    o, lse = randn((4, 4, 16, 1, 128), 0, torch.float32), randn((4, 4, 16, 1), 1, torch.float32)
    return lambda: numba_attn.combine_lse(o, lse)


def first_call(fn):
    call = big_call(fn)
    sync()
    t = time.perf_counter()
    if os.environ.get("KCACHE_PROFILE") == "1":
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(call)
        sync()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    else:
        call()
        sync()
    first = time.perf_counter() - t
    t = time.perf_counter()
    call()
    sync()
    return first, time.perf_counter() - t


def time_one(fn, phase):
    first, second = first_call(fn)
    print(json.dumps({"phase": phase, "fn": fn, "import_s": round(import_s, 3), "first_s": round(first, 3),
                      "second_s": round(second, 4), "cache": dict(kernel_cache.stats),
                      "ok": phase != "warm" or first <= 1.0}))


def time_all():
    times = {fn: round(first_call(fn)[0], 3) for fn in FUNCTIONS}
    print(json.dumps({"phase": "warm, one process", "import_s": round(import_s, 3), "first_s": times,
                      "cache": dict(kernel_cache.stats)}))


def rel_error(got, ref):
    got = np.asarray(got.float().cpu().numpy() if torch.is_tensor(got) else got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check():
    import reference

    rng = np.random.default_rng(0)

    def host(shape, dtype=np.float16, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    def dev(x):
        return torch.as_tensor(x, device="cuda")

    results = {}
    q, k, v = (host((1, 4, 512, 128)) for _ in range(3))
    got, lse = numba_attn.flash_forward(dev(q), dev(k), dev(v), causal=True, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    results["flash_forward"] = (max(rel_error(got, ref), rel_error(lse, ref_lse)), 2e-3)
    q, k, v = host((2, 8, 1, 128)), host((2, 2, 4096, 128)), host((2, 2, 4096, 128))
    results["flash_decode"] = (rel_error(numba_attn.flash_decode(dev(q), dev(k), dev(v)),
                                         reference.attention(q, k, v)), 2e-3)
    q, k, v = (host((1, 2, 1024, 64), scale=0.25) for _ in range(3))
    results["causal_dot_product"] = (rel_error(numba_attn.causal_dot_product(dev(q), dev(k), dev(v)),
                                               reference.causal_dot_product(q, k, v)), 1e-2)
    results["linear_attention"] = (rel_error(numba_attn.linear_attention(dev(q), dev(k), dev(v)),
                                             reference.linear_attention(q, k, v)), 1e-2)
    o, lse = host((4, 1, 4, 3, 128), np.float32), host((4, 1, 4, 3), np.float32)
    got_o, got_lse = numba_attn.combine_lse(dev(o), dev(lse))
    ref_o, ref_lse = reference.combine_lse(o, lse)
    results["combine_lse"] = (max(rel_error(got_o, ref_o), rel_error(got_lse, ref_lse)), 1e-5)
    sync()
    ok = all(err <= tol for err, tol in results.values())
    print(json.dumps({"check": {fn: {"rel_error": f"{err:.2e}", "tolerance": tol, "ok": err <= tol}
                                for fn, (err, tol) in results.items()},
                      "fast_launch": os.environ.get("NUMBA_ATTN_FAST_LAUNCH", "1"), "cache": dict(kernel_cache.stats),
                      "all_loaded": kernel_cache.stats.get("miss", 0) == 0, "ok": ok}))
    return ok


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "time":
        time_one(sys.argv[2], sys.argv[3])
    elif mode == "all":
        time_all()
    else:
        sys.exit(0 if check() else 1)
PY
status=0
fail() { echo "FAILED: $*" | tee -a "$out/summary.txt"; status=1; }
: > "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"

echo "== 1. tests/runtime/test_kernel_cache.py"
parallel="-o addopts=-ra"  # (pyproject's addopts ask for pytest-xdist)
python3 -c "import xdist" 2>/dev/null && parallel="-n 4"
timeout 150 python3 -m pytest -q -p no:cacheprovider $parallel tests/runtime/test_kernel_cache.py 2>&1 \
  | tail -15 | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "tests"

echo "== 2. first call per public function, a fresh process each (cache: $cache)"
: > "$out/times.jsonl"
for phase in cold warm; do
  for fn in flash_forward flash_decode causal_dot_product linear_attention combine_lse; do
    line=$(NUMBA_ATTN_CACHE_DIR=$cache timeout 150 python3 "$probe" time $fn $phase 2>>"$out/stderr.txt" | tail -1)
    echo "$line" | tee -a "$out/times.jsonl"
    case "$line" in
      *'"ok": true'*) ;;
      *) fail "$phase first call of $fn"
         [ "$phase" = warm ] && NUMBA_ATTN_CACHE_DIR=$cache KCACHE_PROFILE=1 timeout 60 python3 "$probe" time $fn \
           profile >/dev/null 2>"$out/profile-$fn.txt" ;;
    esac
  done
done
NUMBA_ATTN_CACHE_DIR=$cache timeout 60 python3 "$probe" all 2>>"$out/stderr.txt" | tail -1 | tee -a "$out/times.jsonl"
echo "kernel files: $(ls "$cache/kernels" | wc -l), $(du -sh "$cache/kernels" | cut -f1)" | tee -a "$out/summary.txt"

echo "== 3. results against reference after a warm load"
for run in first second fast_launch_off; do
  env=()
  [ $run = fast_launch_off ] && env=(NUMBA_ATTN_FAST_LAUNCH=0)
  line=$(env ${env[@]+"${env[@]}"} NUMBA_ATTN_CACHE_DIR=$cache timeout 120 python3 "$probe" check \
         2>>"$out/stderr.txt" | tail -1)
  echo "$line" | tee -a "$out/check.jsonl"
  case "$line" in *'"ok": true'*) ;; *) fail "check ($run)";; esac
  if [ $run != first ]; then
    case "$line" in *'"all_loaded": true'*) ;; *) fail "check ($run) compiled instead of loading";; esac
  fi
done

python3 - "$out/times.jsonl" <<'PY' | tee -a "$out/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print(f"{'function':20s} {'cold s':>8s} {'warm s':>8s} {'import s (warm)':>16s}")
by = {(r["phase"], r.get("fn")): r for r in rows}
for fn in ("flash_forward", "flash_decode", "causal_dot_product", "linear_attention", "combine_lse"):
    c, w = by.get(("cold", fn), {}), by.get(("warm", fn), {})
    print(f"{fn:20s} {c.get('first_s', float('nan')):8.3f} {w.get('first_s', float('nan')):8.3f} "
          f"{w.get('import_s', float('nan')):16.3f}")
PY
rm -rf "$work"
[ $status -eq 0 ] && echo "GPU_CHECK_KCACHE: all passed" | tee -a "$out/summary.txt"
exit $status
