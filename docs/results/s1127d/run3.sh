# Call A (H100): the window target with windowed calls on the persistent form, then the bf16 sweep against cuDNN
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16 128:bfloat16,float16 2>&1 | grep -v -i warn
timeout 150 python3 scripts/bench_issue29.py --part window --out $OUT/issue29_window.json 2>&1 | grep -v -i warn | tail -8
timeout 300 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes bf16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
  --out $OUT/sweep_bf16 > $OUT/sweep_bf16.log 2>&1; grep -A20 "^| size" $OUT/sweep_bf16/results.md | head -40
