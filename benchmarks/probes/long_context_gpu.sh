#!/usr/bin/env bash
# The long-context runs behind benchmarks/results/long-context.md, on one GPU.
# By phase (each fits one device call):
#   check  - the GPU tests of the key-bias skip and decode backends, then decode host time against context
#   mpt    - MPT-StoryWriter shape at full depth (32 layers), 32k and 65k, patched
#   bloom  - BLOOM-7B1 shape at full depth (30 layers), 16k and 65k, patched and upstream
#   llama  - LLaMA-3.1-8B shape at full depth, 128k, both decode modes and generate(), patched and upstream
#   others - Falcon-ALiBi and Qwen3-8B shapes at 4 layers, 16k-128k
#   RESULTS=$OUT bash benchmarks/probes/long_context_gpu.sh check mpt
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    check)
      timeout 110 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_alibi_flash.py \
        tests/patches/test_decode_attention.py tests/kernels/test_alibi_flash.py -k "key_bias or far_key or running_max or cuda or compiles" 2>&1 | tail -n 6
      timeout 90 "$PYTHON" benchmarks/probes/decode_host_time.py --models mpt bloom --contexts 1024 65536 --layers 2 --steps 6 \
        --trace-sync --out "$RESULTS/decode-host-time.json" 2>&1 | grep -v "^---\|profiler.py\|_warn_once" ;;
    mpt)
      timeout 130 "$PYTHON" -m torchembed bench long --models mpt --variants patched --layers 32 --contexts 32768 65536 \
        --steps 8 --out "$RESULTS" --name long-context-mpt-32-after --max-seconds 100 2>&1 | tail -n 4 ;;
    bloom)
      timeout 190 "$PYTHON" -m torchembed bench long --models bloom --layers 30 --contexts 16384 65536 \
        --steps 6 --out "$RESULTS" --name long-context-bloom-30 --max-seconds 160 2>&1 | tail -n 8 ;;
    llama)
      timeout 330 "$PYTHON" -m torchembed bench long --models llama --layers 32 --contexts 131072 \
        --steps 8 --generate 32 --out "$RESULTS" --name long-context-llama-32 --max-seconds 300 2>&1 | tail -n 8 ;;
    others)
      timeout 240 "$PYTHON" -m torchembed bench long --models falcon qwen3 --layers 4 --contexts 16384 65536 131072 \
        --steps 8 --out "$RESULTS" --name long-context-falcon-qwen3-4 --max-seconds 200 2>&1 | tail -n 12 ;;
  esac
done
