# Call 4 (H100, tree of main + the register-pool check; the kernels of f3d688a / 71310a6): the bf16 sweep on these
# kernels (none ran on 71310a6's), then the causal keys re-tuned with narrow tiles (the table was tuned on whole
# tiles), D64 first; then the fp16 sweep if time is left.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | tail -1
date -u +%H:%M:%S
timeout 150 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes bf16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/sweep_bf16 \
  > $OUT/sweep_bf16.log 2>&1; tail -22 $OUT/sweep_bf16.log
date -u +%H:%M:%S
cp numba_attn/forward/tuned/sm90.json $OUT/sm90.json
timeout 230 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 64 128 --dtypes bfloat16 float16 \
  --backend wgmma_ws --masks causal --time-limit 190 > $OUT/tune.log 2>&1; tail -30 $OUT/tune.log
date -u +%H:%M:%S
