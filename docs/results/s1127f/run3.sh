# Call 3: h/snake-causal (main + every other persistent round reversed under a causal mask, without the carried
# tails) -- its GPU tests, then the persistent form forced on main and the branch in turn, twice.
# Here first: mkdir -p .ab/sc && git archive h/snake-causal numba_attn scripts tests reference pyproject.toml | tar -x -C .ab/sc
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
nvidia-smi --query-gpu=name --format=csv,noheader
tree "$ROOT/.ab/sc" timeout 250 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_wgmma_ws.py \
  tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_window.py 2>&1 | tail -3 | tee $OUT/sc_tests.log
for pass in 1 2; do
  for t in "$ROOT" "$ROOT/.ab/sc"; do
    tree "$t" timeout 100 python3 $ROOT/docs/results/s1127f/probe_carry.py "$(basename $t)$pass" \
      d128:1024,2048,4096 d64:1024,4096 2>&1 | grep -v -i warn | tee -a $OUT/sc_ab.log
  done
done
