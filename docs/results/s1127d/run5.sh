# Call C (H100): varlen (issue #29's target, D64 re-measured), fp8 at 16k, the window test's fix
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 100 python3 docs/results/s1127d/probe_fp8.py 16384 2>&1 | grep -v -i warn | tee $OUT/probe_fp8_16k.log
timeout 60 python3 -m pytest -q -m gpu -p no:benchmark "tests/forward/test_flash_wgmma_ws.py::test_window_and_softcap_match_the_wgmma_kernel" 2>&1 | tail -1
timeout 240 python3 scripts/bench_issue29.py --part varlen --out $OUT/issue29_varlen.json 2>&1 | grep -v -i warn | tail -12
