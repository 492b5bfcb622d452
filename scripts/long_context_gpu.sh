#!/usr/bin/env bash
# The long-context runs on one GPU, by phase (each fits one device call):
#   check  - the GPU tests of the kernel paths and decode backends, then decode host time against context
#   mpt    - MPT-StoryWriter shape at full depth (32 layers), 16k-65k, patched and upstream, with generate()
#   others - BLOOM-7B1 at full depth (30 layers); Falcon-ALiBi, Qwen3-8B at 4 layers; 16k-65k
#   llama  - LLaMA-3.1-8B shape at full depth, 32k-128k, both decode modes
#   RESULTS=$OUT bash scripts/long_context_gpu.sh check mpt
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    check)
      timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_alibi_flash.py \
        tests/patches/test_attention_backends.py 2>&1 | tail -n 6
      timeout 200 "$PYTHON" scripts/decode_host_time.py --models mpt llama --contexts 1024 8192 65536 --layers 4 \
        --steps 10 --out "$RESULTS/decode-host-time.json" 2>&1 | tail -n 60 ;;
    mpt)
      timeout 420 "$PYTHON" -m torchembed bench long --models mpt --layers 32 --contexts 16384 32768 65536 \
        --steps 8 --generate 8 --out "$RESULTS" --name long-context-mpt-32 --max-seconds 360 2>&1 | tail -n 30 ;;
    others)
      timeout 330 "$PYTHON" -m torchembed bench long --models bloom --layers 30 --contexts 16384 32768 65536 \
        --steps 8 --out "$RESULTS" --name long-context-bloom-30 --max-seconds 280 2>&1 | tail -n 20
      timeout 240 "$PYTHON" -m torchembed bench long --models falcon qwen3 --layers 4 --contexts 16384 65536 131072 \
        --steps 8 --out "$RESULTS" --name long-context-falcon-qwen3-4 --max-seconds 200 2>&1 | tail -n 20 ;;
    llama)
      timeout 560 "$PYTHON" -m torchembed bench long --models llama --layers 32 --contexts 32768 131072 \
        --steps 8 --generate 8 --out "$RESULTS" --name long-context-llama-32 --max-seconds 480 2>&1 | tail -n 20 ;;
  esac
done
