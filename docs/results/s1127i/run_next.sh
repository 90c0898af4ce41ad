# For the next session (issue #30). State at 71310a6 (H100, 2026-11-27 15:00-16:11): narrow tiles (6c3118d) and
# only where a call can meet one (71310a6); fp8 default 224-key persistent (ee4fd2e). fp8 x our bf16: 4k 1.35x full /
# 1.31x causal (15:52, 6c3118d), 16k 1.43x / 1.38x (16:06, 71310a6); target 1.4x at N >= 4k. 16-bit sweeps were on
# 6c3118d (narrow code in every kernel), not on 71310a6. Device calls, H100 (kind nvidia-h100-x1).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
# Call 1 (~450 s): the fp8 file's WS tests whole (71310a6's runs stopped at 52 of 53, none failed; they need the
# prewarm first and -n 8: compiling narrow and whole kernels doubles the work), then the sweep on 71310a6, bf16.
timeout 90 python3 scripts/prewarm_ws.py 128:fp8 64:fp8 2>&1 | tail -1
timeout 230 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8.py -k wgmma_ws 2>&1 \
  | tail -2 | tee $OUT/tests_fp8.log
timeout 150 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes bf16 \
  --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/sweep_bf16
# Call 2 (~400 s): the fp16 sweep; then re-tune the causal keys with narrow tiles (the tables were tuned on whole
# tiles: a causal key may now prefer larger tiles), e.g.
#   scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 128 64 --backend wgmma_ws --time-limit 200
#   (copy numba_attn/forward/tuned/sm90.json to $OUT first; take only the causal keys whose choice changed, then a
#   same-lease A/B sweep -- scripts/ab_sweep.sh -- of the old table against the new)
