# Call 2 (H100): h/snake (persistent rounds in snake order) against main with the s1127d probe, both trees; then the
# backward GPU tests on h/uniform-bwd (prepared here: git archive <branch> ... | tar -x -C .ab/<name>).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
date -u +%H:%M:%S
for t in "$ROOT" "$ROOT/.ab/snake"; do
  tree "$t" timeout 170 python3 $ROOT/docs/results/s1127d/probe_uniform.py "$(basename $t)" d128:1024,2048,4096,16384 \
    d64:1024,4096 window 2>&1 | grep -v -i warn | tee -a $OUT/snake_ab.log
done
date -u +%H:%M:%S
tree "$ROOT/.ab/bwd" timeout 220 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/backward 2>&1 | tail -4 \
  | tee $OUT/bwd_tests.log
date -u +%H:%M:%S
