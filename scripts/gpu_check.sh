#!/usr/bin/env bash
# One GPU session's checks in one command: the whole test suite on the GPU, then optional extra commands.
#   bash scripts/gpu_check.sh [OUTDIR] [-- extra command ...]
# Wheels in .whl/ (numpy<2.5 for numba-cuda, fla-core for the linear-attention peer) are installed to /tmp/site
# first when present, for machines without a package index.
set -uo pipefail
out=${1:-gpu_out}; shift || true
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
python3 -c "import numpy, numba, numba_cuda, cupy, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$out/device.txt"
python3 -m pytest -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tail -40 | tee "$out/pytest.txt"
if [ "${1:-}" = "--" ]; then shift; "$@"; fi
