# For the next session (issue #30). This session's device was an H200 only; the targets are for the H100.
# Call 1 (H100, ~450 s): the forward sweeps against cuDNN on main (86621b0 snake rounds, 249e77d causal persistent
# entries, 371c771 D64 three-consumer 128-key entries), bf16 and fp16, then fp8 against our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | grep -v -i warn
for dt in bf16 fp16; do
  timeout 120 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_$dt > $OUT/sweep_$dt.log 2>&1; grep "^| [0-9]" $OUT/sweep_$dt/results.md
done
timeout 70 python3 docs/results/s1127e/probe_fp8_persistent.py 4096 16384 2>&1 | grep -v -i warn | tee $OUT/fp8.log
# Call 2 (~300 s): head dim 64's causal rows and 1k rows -- persistent forms of the three-consumer and 192-key
# tiles (with the snake rounds now; the carried tails are not needed for them), against the shipped choice. Offline
# (ptxas sm_90a, 2026-11-27, causal and not): 3x96p and 192p no spills; 3x128p 4 bytes (one STL, one LDL):
#   THREE=consumers=3,producer_registers=32,consumer_registers=160
#   python3 docs/results/s1127f/probe_configs.py d=64 n=1024,2048,4096 rounds=3 \
#     3x128p:block_n=128,stages=2,persistent=True,$THREE 3x96p:block_n=96,stages=3,persistent=True,$THREE \
#     192p:block_n=192,stages=2,persistent=True
# and where one wins a row by more than the rounds' spread: add it to TUNING_CANDIDATES, retune head dim 64
# (scripts/tune_defaults.py --merge --headdims 64 --backend wgmma_ws), take the keys that chose it, sweep again.
# Call 3 (~300 s): what bounds the kernels (never measured): the WS kernels without their softmax / P conversion.
#   python3 docs/results/s1127f/probe_parts.py n=1024,4096 rounds=3
#   python3 scripts/check_fp8.py --part probe --lengths 4096,16384 --reps 20
