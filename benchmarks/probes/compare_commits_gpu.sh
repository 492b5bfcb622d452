#!/usr/bin/env bash
# Speed of this checkout against another commit's tree, side by side on one GPU.
# BASE is a folder with a checkout of the other commit. Measured: RoPE device time (README shapes),
# host time per decode call of each public RoPE route, the ALiBi layer table (one attention layer,
# forward), e2e decode of LLaMA.
#   BASE=_baseline RESULTS=$OUT bash benchmarks/probes/compare_commits_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
BASE=${BASE:?a folder holding the other commit\'s tree}
RESULTS=${RESULTS:-benchmarks/results/compare-$(date +%F)}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TORCHEMBED_CACHE=${TORCHEMBED_CACHE:-/tmp/torchembed-cache}
for side in base new; do
  tree=$([ $side = base ] && echo "$BASE" || echo .)
  echo "=== $side ($tree)"
  ( cd "$tree" && export PYTHONPATH=$PWD
    timeout 100 "$PYTHON" -m torchembed bench rope --out "$RESULTS/$side" --providers torchembed torchembed-hf \
      --no-backward --no-accuracy --max-seconds 60 2>&1 | grep "^|" | head -n 14
    timeout 60 "$PYTHON" benchmarks/host_overhead.py --calls 1000 --repeats 5 2>&1 | tail -n 16
    timeout 100 "$PYTHON" -m torchembed bench alibi --kernel --out "$RESULTS/$side" --passes forward --max-seconds 60 2>&1 \
      | grep "^|" | head -n 16
    timeout 100 "$PYTHON" -m torchembed bench e2e --out "$RESULTS/$side" --models llama --variants upstream patched \
      --phases decode --batch-sizes 1 --prompt-lens 512 --repeats 3 --max-seconds 60 2>&1 | grep "^|" | head -n 8 )
done
