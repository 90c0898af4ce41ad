# Call 1 (H100): the short rows' host floor (probe_1k ws=1, host profile, small sweep), D64 1k bf16 candidates.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16 128:fp8 2>&1 | tail -2
date -u +%H:%M:%S
timeout 60 python3 docs/results/s1127h/profile_host.py 2>&1 | grep -v -i warn | tee $OUT/profile_host.log
timeout 150 python3 docs/results/s1127g/probe_1k.py ws=1 2>&1 | grep -v -i warn | tee $OUT/probe_1k_ws.log
date -u +%H:%M:%S
timeout 90 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes bf16 \
  --seqlens 512,1k,2k --providers "=numba_attn,=numba_attn[wgmma_ws],=numba_attn[wgmma],=torch-sdpa-cudnn" \
  --budget 0.3 --no-plot --out $OUT/sweep_small_bf16 > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_small_bf16/results.md
rm -f $OUT/*/results.csv
date -u +%H:%M:%S
timeout 120 python3 docs/results/s1127f/probe_configs.py d=64 n=512,1024 rounds=5 \
  2x128p:block_n=128,stages=2,persistent=True \
  3x128p:block_n=128,stages=2,persistent=True,consumers=3,producer_registers=32,consumer_registers=160 2>&1 \
  | grep -v -i warn | tee $OUT/d64_1k.log
date -u +%H:%M:%S
