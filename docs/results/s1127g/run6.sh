# Call 6 (issue #30): the final D64 state -- dispatch.WS_MIN_SEQLEN_K_AT (D64 causal 1k on the WS kernel) and the
# table with the persistent 3x128 keys (fp16 causal 16k's entry kept) -- the dispatch GPU test and the D64 sweep.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 90 python3 -m pytest -q -p no:benchmark -m gpu tests/forward/test_flash_wgmma_ws.py -k "dispatch_by_head_dim" \
  2>&1 | tail -2 | tee $OUT/dispatch_test.log
for dt in bf16 fp16; do
  timeout 70 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_d64_$dt > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_d64_$dt/results.md; rm -f $OUT/sweep_d64_$dt/results.csv
done
date -u +%H:%M:%S
