# Call 1 (H100, branch h/fp8-mma-sums rebased on 68a962e: each tile's P row sums from the P V MMA folded into
# float32, the MMA's column cleared): errors of the worst shapes and 4k rates, the 16k rates, then the GPU tests
# of the fp8 WS forward (which include the fp8_sums configuration).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 120 python3 -u docs/results/s1127j/probe_sums.py n=4096 rounds=2 configs=224p,224ps check=short 2>&1 \
  | grep -v -i warn | tee $OUT/sums_4k.log
date -u +%H:%M:%S
timeout 80 python3 -u docs/results/s1127j/probe_sums.py n=16384 rounds=2 configs=224p,224ps check=0 2>&1 \
  | grep -v -i warn | tee $OUT/sums_16k.log
date -u +%H:%M:%S
timeout 250 python3 -m pytest -q -p no:benchmark -x tests/forward/test_flash_fp8_ws.py \
  "tests/forward/test_flash_fp8.py" -k "wgmma_ws or ws" 2>&1 | tail -15 | tee $OUT/tests.log
date -u +%H:%M:%S
