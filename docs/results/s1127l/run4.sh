# Call 4 (issue #30): where a block's time goes at D64 1k (the 16-bit rows below 0.9x cuDNN) and in the fp8 4k
# rows (below 1.4x our bf16): scripts/ws_timeline.py's stamps, with a long-sequence run of each for the steady state.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
T="timeout 120 python3 -u scripts/ws_timeline.py --stores tma"
$T --batch 4 --heads 48 --seqlen 1024 --head-dim 64 --full --config block_n=128,persistent=1 2>&1 | grep -v -i warn
$T --batch 4 --heads 48 --seqlen 1024 --head-dim 64 --windows none --config block_n=128,persistent=1 2>&1 | grep -v -i warn
$T --batch 1 --heads 48 --seqlen 16384 --head-dim 64 --full --config block_n=128,persistent=1 2>&1 | grep -v -i warn
$T --batch 4 --heads 48 --seqlen 1024 --head-dim 64 --full --config block_n=128 2>&1 | grep -v -i warn
date -u +%H:%M:%S
$T --batch 4 --heads 32 --seqlen 4096 --dtype fp8 --full --config default 2>&1 | grep -v -i warn
$T --batch 4 --heads 32 --seqlen 4096 --dtype fp8 --windows none --config default 2>&1 | grep -v -i warn
$T --batch 1 --heads 32 --seqlen 16384 --dtype fp8 --full --config default 2>&1 | grep -v -i warn
$T --batch 4 --heads 32 --seqlen 4096 --full --config block_n=128,persistent=1 2>&1 | grep -v -i warn
date -u +%H:%M:%S
