# One device call (H100, 2026-11-27): D64 H48 B4 with the D64 entries of the WS tuning (the shipped table) against
# the wgmma kernel and cuDNN, bf16 and fp16, 1k-16k; then the D128 part of probe_configs.py (window, 3 consumers).
# (prewarm_ws.py ran as docs/results/s1127c/prewarm.py then, the same code)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | grep -v -i warn
for dt in bf16 fp16; do
  timeout 170 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=numba_attn[wgmma],=numba_attn[wgmma_ws],=torch-sdpa-cudnn" \
    --budget 0.2 --no-plot --out $OUT/sweep64_$dt > $OUT/sweep64_$dt.log 2>&1; tail -3 $OUT/sweep64_$dt.log
  cat $OUT/sweep64_$dt/results.md | head -60
done
timeout 150 python3 docs/results/s1127c/probe_configs.py d128 2>&1 | grep -v -i warn | tee $OUT/probe_d128.log | tail -12
