# Call 2 (H100, h/fp8-mma-sums): call 1's two failing tests with their messages, then the 16k rates (call 1's 16k
# probe ran past its 80 s).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 -m pytest -q -p no:benchmark -p no:xdist --tb=short tests/forward/test_flash_fp8.py \
  -k "test_tile_configs_descales_and_outputs and wgmma_ws and config15" 2>&1 | grep -v -i warn | tail -60 \
  | tee $OUT/failing.log
date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127j/probe_sums.py n=16384 rounds=2 configs=224p,224ps check=0 2>&1 \
  | grep -v -i warn | tee $OUT/sums_16k.log
date -u +%H:%M:%S
