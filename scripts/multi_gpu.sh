#!/usr/bin/env bash
# Patched models on every GPU of this host: a model split over them (logits vs upstream, generation
# speed), DDP and FSDP training parity with one GPU, tensor parallelism (tp_plan="auto"), training throughput. See scripts/multi_gpu.py.
#   bash scripts/multi_gpu.sh                    # all parts, results in benchmarks/results/<date>/
#   PARTS=infer RESULTS=/tmp/r bash scripts/multi_gpu.sh
# NCCL's NVLink multicast stays off: a program using it can take a shared host's GPUs out of service.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torchembed.patches" 2>/dev/null || "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
exec "$PYTHON" scripts/multi_gpu.py --parts "${PARTS:-infer,parity,tp,speed}" --out "${RESULTS:-benchmarks/results/$(date +%F)}" "$@"
