#!/usr/bin/env bash
# Issues #27 and #29 on a GPU in one command: flash_decode's KV-cache tests (real sizes, a CUDA graph that follows
# growing device cache_seqlens), the planned-call and first-call-in-a-capture tests, host time per call beside
# flash_forward's replay and torch SDPA, and paged against dense decoding bandwidth.
#   bash scripts/gpu_check_decode_kv.sh [OUTDIR]
# Wheels in .whl/ are installed to /tmp/site first when present (as scripts/gpu_check.sh does).
set -uo pipefail
out=${1:-gpu_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/decode/test_decode_kvcache_gpu.py tests/decode/test_decode_cached.py \
  "tests/runtime/test_capture.py::test_first_call_inside_a_capture[flash_decode]" \
  2>&1 | grep -E "passed|failed|FAILED|ERROR|Error" | tail -15 | tee "$out/pytest.txt"
python3 scripts/startup.py --only host --cases "decode,sdpa,flash_forward fp16" --calls 300 2>&1 | tee "$out/host.txt"
python3 scripts/decode_kvcache_bench.py --quick 2>&1 | tee "$out/bench.txt"
