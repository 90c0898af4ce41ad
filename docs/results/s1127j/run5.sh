# Call 5 (H100, main + the register-pool check + 6 re-tuned causal keys): the keys without a mask re-tuned (tuned
# before narrow tiles, which a non-causal call meets where its keys end inside a tile, e.g. 4k keys in 176-key tiles)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 scripts/prewarm_ws.py 128:bfloat16,float16 64:bfloat16,float16 2>&1 | tail -1
date -u +%H:%M:%S
cp numba_attn/forward/tuned/sm90.json $OUT/sm90.json
timeout 250 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 128 64 --dtypes bfloat16 float16 \
  --backend wgmma_ws --masks full --time-limit 200 > $OUT/tune.log 2>&1; tail -32 $OUT/tune.log
date -u +%H:%M:%S
