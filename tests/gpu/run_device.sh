#!/bin/bash
# The H200 run of the layer harness (from the repository root of the copy sent to the device):
#   bash tests/gpu/run_device.sh [pytest|step|all]   -> logs and JSON under $OUT
# Installs the carried wheels (.gpu/wheels) into /tmp/site, unpacks .gpu/vllm_py.tar.gz into
# /tmp/vllm_py and puts both ahead of the repository on PYTHONPATH; the device's own torch and
# Triton serve vLLM's sources.
set -u
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl \
  || { echo "wheel install failed"; exit 2; }
python3 -c "from pathlib import Path; from tests.gpu.pack import unpack; unpack(Path('.gpu/vllm_py.tar.gz'), Path('/tmp/vllm_py'))" \
  || { echo "unpack failed"; exit 2; }
export PYTHONPATH=/tmp/vllm_py:/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
rc=0
log="$out/run.log"
if [ "$what" = pytest ] || [ "$what" = all ]; then
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rA -p no:cacheprovider --noconftest -s \
    tests/gpu/test_layers_gpu.py 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = step ] || [ "$what" = all ]; then
  timeout "${STEP_TIMEOUT:-240}" python3 -m tests.gpu.step_cost --json "$out/step_cost.json" ${STEP_ARGS:-} 2>&1 \
    | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
