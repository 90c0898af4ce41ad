# Call 5 (issue #30): D64's threshold for the WS kernel (dispatch.WS_MIN_KEYS_AT, {64: 1024} -> none: causal 1k went
# to "wgmma", 0.74x cuDNN, where the WS kernel's persistent snake form reads 0.88x): both kernels forced against
# cuDNN at the rows it decides, then the D64 sweep with the tree's threshold (none) and call 3's table.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 docs/results/s1127g/probe_backends.py rounds=3 2>&1 | grep -v -i warn | tee $OUT/backends.log
date -u +%H:%M:%S
for dt in bf16 fp16; do
  timeout 70 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 512,1k,2k,4k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_d64_$dt > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_d64_$dt/results.md; rm -f $OUT/sweep_d64_$dt/results.csv
done
date -u +%H:%M:%S
