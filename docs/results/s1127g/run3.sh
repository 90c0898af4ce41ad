# Call 3 (issue #30): the persistent three-consumer 128-key form among the candidates (call 2, H200: it led the
# shipped choice at D64 2k-4k): the WS GPU tests, a head dim 64 retune that takes only the keys choosing it
# (tune_defaults --take), and the D64 sweep with that table (call 1's sweep is the before, if the same card).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | grep -v -i warn
cp numba_attn/forward/tuned/sm90.json $OUT/sm90.json
timeout 130 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 64 --backend wgmma_ws \
  --take block_n=128,stages=2,persistent=True,consumers=3 --time-limit 100 2>&1 | grep -v -i warn > $OUT/tune.log
tail -4 $OUT/tune.log; python3 -c "import json; print(json.load(open('$OUT/sm90.json'))['source']['taken'])"
cp $OUT/sm90.json numba_attn/forward/tuned/sm90.json
for dt in bf16 fp16; do
  timeout 70 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_d64_$dt > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_d64_$dt/results.md
done
date -u +%H:%M:%S
timeout 150 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -3 \
  | tee $OUT/ws_tests.log
date -u +%H:%M:%S
