# Call 5 (H100): same-lease A/B sweep of narrow tiles (B: this tree) against the tree before them (A: ee4fd2e, in
# .ab/base), bf16 B4 D128 H32 / D64 H48, 1k-4k, causal and not, two rounds A B A B (scripts/ab_sweep.sh).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
(cd .ab/base && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16 128:bfloat16 2>&1 \
  | tail -1) &
timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16 128:bfloat16 2>&1 | tail -1
wait; date -u +%H:%M:%S
AB_BUDGET=0.3 timeout 420 bash scripts/ab_sweep.sh .ab/base $OUT/ab 2 -- --sweeps flash --direction forward \
  --flash-configs 128:32,64:48 --dtypes bf16 --seqlens 1k,2k,4k
date -u +%H:%M:%S
for f in $OUT/ab/ab_best.md $OUT/ab/aa.md $OUT/ab/bb.md; do echo "== $f"; cat $f; done
rm -rf $OUT/ab/ptx_a $OUT/ab/ptx_b
