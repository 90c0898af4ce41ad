# Call 3 (H100): narrow tiles against whole ones with calls replayed (the short rows' host time hidden, as in the
# sweep), then the WS kernel's whole GPU test file (call 2 ran out of time in it, no failure before).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127i/probe_narrow.py rounds=5 replay=1 \
  cases=d128c1k,d64c1k,d64f1k,d64c2k,d128c4k,fp8f4k,fp8c4k 2>&1 | grep -v -i warn | tee $OUT/narrow_replay.log
date -u +%H:%M:%S
timeout 330 python3 -m pytest -q -p no:benchmark -m gpu -n 12 tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -4 \
  | tee $OUT/tests_ws.log
date -u +%H:%M:%S
