# Call 3 (H100, h/fp8-mma-sums): call 1's two failing tests with their messages (call 2's pytest line was refused).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 200 python3 -m pytest -q -p no:benchmark -n 2 --tb=short tests/forward/test_flash_fp8.py \
  -k "test_tile_configs_descales_and_outputs and wgmma_ws and config15" 2>&1 | grep -v -i warn | tail -80 \
  | tee $OUT/failing.log
date -u +%H:%M:%S
