# Call 2 (issue #30): head dim 64 persistent forms (three consumers x 128 / x 96 keys, 192-key tiles) against the
# shipped choice and cuDNN, alternating rounds; D128 full 4k's alternatives; what bounds fp8 (part probes).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16 128:bfloat16 2>&1 | grep -v -i warn
THREE=consumers=3,producer_registers=32,consumer_registers=160
timeout 240 python3 docs/results/s1127f/probe_configs.py d=64 n=1024,2048,4096 rounds=3 \
  3x128p:block_n=128,stages=2,persistent=True,$THREE 3x96p:block_n=96,stages=3,persistent=True,$THREE \
  192p:block_n=192,stages=2,persistent=True 2>&1 | grep -v -i warn | tee $OUT/d64_forms.log
date -u +%H:%M:%S
timeout 100 python3 docs/results/s1127f/probe_configs.py d=128 n=2048,4096 rounds=3 \
  p:block_n=128,stages=2,persistent=True s3:block_n=128,stages=3 \
  3x64:block_n=64,stages=4,$THREE 2>&1 | grep -v -i warn | tee $OUT/d128_forms.log
date -u +%H:%M:%S
timeout 100 python3 scripts/check_fp8.py --part probe --lengths 4096,16384 --reps 20 2>&1 | grep -v -i warn \
  | tee $OUT/fp8_parts.log
date -u +%H:%M:%S
