# For the next session (issue #30). State at 98c9f77 (H100, 2026-11-27 11:29-11:59): met at every N >= 4k but D128
# non-causal 4k (0.99x, a tie); at 1k-2k not met: D64 non-causal 1k bf16 (0.86x), D64 causal 1k (0.73x, on "wgmma");
# fp8 1.26-1.28x at 4k (target 1.4x). Device calls, H100 (kind nvidia-h100-x1):
# Call 1 (~250 s): where the sweeps' host floor at <= 1k comes from, and the WS kernel at D64 causal 1k as the sweep
# times it (the provider numba_attn[wgmma_ws] forces it), beside the default and cuDNN.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 docs/results/s1127g/probe_1k.py ws=1 2>&1 | grep -v -i warn | tee $OUT/probe_1k_ws.log
for dt in bf16 fp16; do
  timeout 90 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 512,1k,2k --providers "=numba_attn,=numba_attn[wgmma_ws],=numba_attn[wgmma],=torch-sdpa-cudnn" \
    --budget 0.3 --no-plot --out $OUT/sweep_small_$dt > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_small_$dt/results.md
done
# If the WS rows at causal 1k read as the probes do (~0.88-0.94x cuDNN) once the floor is understood: the seqlen_k
# threshold at D64 (WS_MIN_SEQLEN_K_AT = {64: 1024}, tried in calls 5-6 of this session, see benchmarks.md) again.
# Call 2: D64 non-causal 1k bf16 -- the key bfloat16|64|False|262144|1024 covers B4 N512 and N1k; the retune had
# 2x128 persistent lose 5.9 % at 1k and three consumers x 128 persistent lose ~5.5 % at 512 (fp16's key took the
# latter: its 1k row 0.81 -> 0.92x). Probe both at 512 and 1k (probe_configs.py d=64 n=512,1024 rounds=5 ...).
# Call 3 (~250 s): the fp8 candidates of 9080ec0 (224-key tiles; three consumers of 96- / 64-key tiles), their GPU
# tests, then timed against our bf16. A winner by more than the rounds' spread at 4k and 16k becomes
# wgmma_ws_fp8.DEFAULT_CONFIG (fp8 has no tuner).
#   timeout 100 python3 scripts/prewarm_ws.py 128:fp8
#   timeout 150 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_fp8.py
#   timeout 200 python3 docs/results/s1127g/probe_fp8_configs.py n=4096,16384 rounds=3
