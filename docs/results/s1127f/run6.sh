# Call 6: h/d64-3x128 (three consumers of 128-key tiles at head dim 64 among the candidates) -- the WS GPU tests,
# the new configurations against the shipped choice and cuDNN at D64, a head dim 64 retune, and the D64 sweep with
# the shipped table and the retuned one.
# Here first: mkdir -p .ab/d64 && git archive h/d64-3x128 numba_attn scripts tests reference pyproject.toml | tar -x -C .ab/d64
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
cd .ab/d64 && export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | grep -v -i warn
timeout 170 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -3 | tee $OUT/d64_tests.log
THREE=consumers=3,producer_registers=32,consumer_registers=160
timeout 130 python3 $ROOT/docs/results/s1127f/probe_configs.py d=64 n=1024,4096,16384 rounds=3 \
  3x128s2:block_n=128,stages=2,$THREE 3x128s3:block_n=128,stages=3,$THREE 2>&1 | grep -v -i warn | tee $OUT/d64_probe.log
cp numba_attn/forward/tuned/sm90.json $OUT/sm90_d64.json
timeout 80 python3 scripts/tune_defaults.py --merge --out $OUT/sm90_d64.json --headdims 64 --backend wgmma_ws \
  --time-limit 55 2>&1 | grep -v -i warn > $OUT/d64_tune.log; tail -4 $OUT/d64_tune.log
sweep() { timeout 60 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes bf16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/$1 > /dev/null 2>&1
  grep "^| [0-9]" $OUT/$1/results.md; }
sweep sweep_d64_shipped
cp $OUT/sm90_d64.json numba_attn/forward/tuned/sm90.json
sweep sweep_d64_retuned
date -u +%H:%M:%S
