# Call B (H100): window (persistent default for windowed calls), fp16 sweep, fp8 against bf16, varlen, GPU tests
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; ls .gpu/cache/kernels 2>/dev/null | wc -l
timeout 100 python3 scripts/prewarm_ws.py 64:float16 128:float16,bfloat16 2>&1 | grep -v -i warn
timeout 90 python3 scripts/bench_issue29.py --part window --out $OUT/issue29_window.json 2>&1 | grep -v -i warn | tail -4
timeout 150 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes fp16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
  --out $OUT/sweep_fp16 > $OUT/sweep_fp16.log 2>&1; grep -A7 "^| size" $OUT/sweep_fp16/results.md | grep "^| [0-9]"
timeout 90 python3 docs/results/s1127d/probe_fp8.py 2>&1 | grep -v -i warn | tee $OUT/probe_fp8.log
timeout 150 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_window.py tests/forward/test_flash_fp8_ws.py "tests/forward/test_flash_wgmma_ws.py::test_window_and_softcap_match_the_wgmma_kernel" 2>&1 | tail -3
