#!/usr/bin/env bash
# Ring attention on the GPUs of one host (issue #31), from the repo root, in two parts that each fit one device call:
#   bash scripts/gpu_check_ring.sh tests [OUTDIR]   # ~5-6 min: the merge kernel's gpu tests, test_ring_gpu.py
#                                                   # (min(GPUs, 4) ranks), and on two of the GPUs when there are 4
#   bash scripts/gpu_check_ring.sh bench [OUTDIR]   # ~4-5 min: bench_ring.py forward 128k-512k (with the per-step
#                                                   # profile) and 1M, forward + backward at 256k, NCCL streams at
#                                                   # high priority; the 128k profile again at normal priority
# Raw rows (JSON) and logs go to OUTDIR (default ring_out). Exit status 0 only if every command passed.
set -uo pipefail
part=${1:?"usage: gpu_check_ring.sh tests|bench [OUTDIR]"}
out=${2:-ring_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then  # (as scripts/gpu_check.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
status=0
run() {  # NAME COMMAND...: COMMAND's output into OUTDIR/NAME.log, its last lines shown
  echo "== $1 ($(date -u +%H:%M:%S) UTC)"
  local name=$1; shift
  "$@" > "$out/$name.log" 2>&1 || { echo "FAILED: $name"; status=1; }
  grep -E "passed|failed|error|^ +[0-9]+ \||^world|^steps" "$out/$name.log" | tail -12
}
case $part in
  tests)
    run merge_gpu python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/distributed/test_ring_merge.py
    run ring_gpu python3 -m pytest -q -p no:cacheprovider -n 0 tests/distributed/test_ring_gpu.py
    if [ "$gpus" -ge 4 ]; then
      CUDA_VISIBLE_DEVICES=0,1 run ring_gpu_2 python3 -m pytest -q -p no:cacheprovider -n 0 \
        tests/distributed/test_ring_gpu.py
    fi
    ;;
  bench)
    world=$(( gpus < 4 ? gpus : 4 ))
    bench="torchrun --nproc-per-node=$world scripts/bench_ring.py"
    run fwd_hp $bench --seqlens 131072,262144,524288 --steps --nccl-high-priority --json "$out/fwd_hp.json"
    run steps_128k $bench --seqlens 131072 --steps --no-single --torch-backends cudnn --json "$out/steps_128k.json"
    run fwd_bwd_hp $bench --seqlens 262144 --backward --nccl-high-priority --json "$out/fwd_bwd_hp.json"
    run fwd_1m_hp $bench --seqlens 1048576 --budget 1 --torch-backends cudnn --nccl-high-priority \
      --json "$out/fwd_1m_hp.json"
    ;;
  *) echo "part: expected tests or bench, got $part"; exit 2 ;;
esac
exit $status
