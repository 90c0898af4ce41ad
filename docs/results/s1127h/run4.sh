# Call 4 (H100): the fp8 WS GPU tests with the TMA store (call 3's ran out of time at 76 %, no failure), then the
# 16k rows: the default (192-key tiles) against 224-key persistent tiles, both with the TMA store, beside our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 90 python3 scripts/prewarm_ws.py 128:fp8 64:fp8 2>&1 | tail -1
date -u +%H:%M:%S
timeout 180 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_fp8.py \
  -k wgmma_ws 2>&1 | tail -4 | tee $OUT/fp8_tests.log
date -u +%H:%M:%S
timeout 100 python3 docs/results/s1127h/probe_fp8_store.py n=16384 rounds=3 configs=192,224p stores=tma 2>&1 \
  | grep -v -i warn | tee $OUT/fp8_store_16k.log
date -u +%H:%M:%S
