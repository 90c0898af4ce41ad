# Call 1 (2026-11-27, second session): h/carry-tail (rebased on main: b71e387 carried tails, 469d5e3 snake rounds,
# f575a2f D64 persistent candidates) -- its GPU tests, then persistent forced on main and on the branch, replayed.
# Here first: mkdir -p .ab/carry .ab/carry1 && git archive h/carry-tail numba_attn scripts tests reference \
#   pyproject.toml | tar -x -C .ab/carry && git archive b71e387 numba_attn scripts | tar -x -C .ab/carry1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
tree "$ROOT/.ab/carry" timeout 270 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_wgmma_ws.py \
  tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_window.py 2>&1 | tail -4 | tee $OUT/carry_tests.log
for t in "$ROOT" "$ROOT/.ab/carry"; do
  tree "$t" env NUMBA_ATTN_REPLAY=1 timeout 150 python3 $ROOT/docs/results/s1127d/probe_uniform.py "$(basename $t)" \
    d128:1024,2048,4096,16384 d64:1024,2048,4096 window 2>&1 | grep -v -i warn | tee -a $OUT/carry_ab.log
done
