# Call 1 (H100): issue #29's decode targets on today's main, then the poly-exp2 probe from h/poly-exp2's tree
# (prepared here: git archive h/poly-exp2 numba_attn scripts | tar -x -C .ab/poly; probe_poly.py copied in).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; date -u +%H:%M:%S
timeout 240 python3 scripts/bench_issue29.py --part decode --out $OUT/issue29_decode.json 2>&1 | grep -v -i warn \
  | tee $OUT/issue29_decode.log | tail -40
date -u +%H:%M:%S
(cd .ab/poly && PYTHONPATH=/tmp/site:$ROOT/.ab/poly NUMBA_ATTN_REPLAY=0 timeout 330 python3 probe_poly.py 2>&1 \
  | grep -v -i warn | tee $OUT/poly.log)
date -u +%H:%M:%S
