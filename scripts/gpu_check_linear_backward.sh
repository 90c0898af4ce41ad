#!/usr/bin/env bash
# GPU check of the linear-attention layer backward (non-causal normaliser from column sums, issue #27's cold start),
# from the repo root, one GPU, ~3 min:
#   bash scripts/gpu_check_linear_backward.sh
# 1. the gpu tests of the layer backward (tests/linear/test_linear_column_sums.py, and the layer's in
#    test_linear_backward.py): PASS / FAIL per test;
# 2. first calls in fresh processes with empty, then warm caches, of the linear_backward family
#    (scripts/startup.py --only first --cases linear_backward; target for linear_attention_backward: <= 10 s empty);
# 3. scripts/time_linear_backward.py at fp16 N4096 with --layer: causal_dot_product_backward against fla (unchanged
#    code: must not be slower), and the layer's backward, non-causal both ways (column sums / products).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then  # as scripts/gpu_check.sh: wheels for machines without a package index
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
unset NUMBA_ENABLE_CUDASIM
status=0
t0=$(date +%s)
python3 -m pytest -q -rA -p no:cacheprovider tests/linear/test_linear_column_sums.py tests/linear/test_linear_backward.py \
  -k "gpu and (layer or noncausal)" 2>&1 | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "INFO tests took $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
python3 scripts/startup.py --only first --cases linear_backward || status=1
echo "INFO startup took $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
python3 scripts/time_linear_backward.py --dtypes fp16 --seqlens 4k --layer --rounds 3 || status=1
echo "INFO timing took $(( $(date +%s) - t0 ))s"
echo "EXIT $status"
exit $status
