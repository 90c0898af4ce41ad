# Call 3 (H100): the fp8 WS kernel's TMA-store epilogue -- GPU tests, then alternating rounds against the register
# stores it had and our bf16 forward.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
(timeout 100 python3 scripts/prewarm_ws.py 128:fp8 64:fp8 2>&1 | tail -1) &
timeout 100 python3 scripts/prewarm_ws.py 128:bfloat16 2>&1 | tail -1; wait
date -u +%H:%M:%S
timeout 200 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_fp8.py \
  2>&1 | tail -4 | tee $OUT/fp8_tests.log
date -u +%H:%M:%S
timeout 230 python3 docs/results/s1127h/probe_fp8_store.py n=4096,16384 rounds=3 2>&1 | grep -v -i warn | tee $OUT/fp8_store.log
date -u +%H:%M:%S
