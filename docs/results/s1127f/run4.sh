# Call 4: main with the snake rounds (7596950's change): retune the WS tables of head dims 128 and 64 (into $OUT),
# then the causal rows' shipped choice, the persistent form and the retune's choice against cuDNN in turn.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader
python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 && cp numba_attn/forward/tuned/sm90.json $OUT/
timeout 150 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 128 64 --backend wgmma_ws \
  --time-limit 85 2>&1 | grep -v -i warn > $OUT/tune.log; tail -5 $OUT/tune.log
timeout 250 python3 docs/results/s1127f/probe_causal.py $OUT/sm90.json rounds=3 2>&1 | grep -v -i warn | tee $OUT/causal.log
