# Call 4 (H100): retune the warp-specialised forward's table entries (D64 and D128, bf16 and fp16: chosen before the
# uniform warpgroup index made the persistent form ~9 % faster), then the sweep vs cuDNN at 1k-4k with the shipped
# table and with the new one, same machine.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | grep -v -i warn
cp numba_attn/forward/tuned/sm90.json $OUT/sm90.json
timeout 110 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 128 64 --backend wgmma_ws \
  --time-limit 85 > $OUT/tune.log 2>&1; tail -12 $OUT/tune.log
date -u +%H:%M:%S
sweep() { timeout 60 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 \
  --dtypes bf16 --seqlens 1k,2k,4k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.25 --no-plot \
  --out $OUT/$1 > /dev/null 2>&1; grep -A6 "^| size" $OUT/$1/results.md | grep "^| [0-9]"; }
sweep sweep_old
cp $OUT/sm90.json numba_attn/forward/tuned/sm90.json
sweep sweep_new
date -u +%H:%M:%S
