# Call 6 (H100, tree of 6c3118d): the fp8 tests of the WS kernel and FlashAttention's test-suite shapes with narrow
# tiles, the fp16 forward sweep against cuDNN, the fp8 rows at 4k (default, 224-key persistent, against our bf16).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:float16 128:float16 128:fp8 2>&1 | tail -1; date -u +%H:%M:%S
timeout 110 python3 -m pytest -q -p no:benchmark -m gpu -n 12 tests/forward/test_flash_fp8.py -k wgmma_ws 2>&1 \
  | tail -2 | tee $OUT/tests_fp8.log
timeout 90 python3 -m pytest -q -p no:benchmark -m gpu -n 12 tests/forward/test_flash_kernels.py 2>&1 | tail -2 \
  | tee $OUT/tests_kernels.log
date -u +%H:%M:%S
timeout 150 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes fp16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/sweep_fp16 \
  2>&1 | grep -v -i warn | tail -3
date -u +%H:%M:%S
timeout 120 python3 -u docs/results/s1127h/probe_fp8_store.py n=4096 rounds=3 configs=224p stores=tma 2>&1 \
  | grep -v -i warn | tee $OUT/fp8_4k.log
date -u +%H:%M:%S
