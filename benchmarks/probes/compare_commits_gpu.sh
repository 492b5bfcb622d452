#!/usr/bin/env bash
# Speed of this checkout against another commit's tree, side by side on one GPU.
# BASE is a folder with a checkout of the other commit. Measured, each on both sides before the next (a run cut
# short still holds whole pairs): RoPE device time (README shapes), host time per decode call of each public RoPE
# route, the ALiBi layer table (one attention layer, forward), the decode attention at 16k/64k/128k keys (batch 1
# grouped heads, the padded batch, BLOOM's ALiBi), e2e decode of LLaMA. SECONDS_EACH caps each benchmark.
#   BASE=_baseline RESULTS=$OUT bash benchmarks/probes/compare_commits_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
BASE=${BASE:?a folder holding the other commit\'s tree}
RESULTS=${RESULTS:-benchmarks/results/compare-$(date +%F)}
EACH=${SECONDS_EACH:-60}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TORCHEMBED_CACHE=${TORCHEMBED_CACHE:-/tmp/torchembed-cache}
on_both() {  # on_both LIMIT LINES COMMAND...: run the command in each tree (--out under RESULTS/side)
  local limit=$1 lines=$2
  shift 2
  for side in base new; do
    tree=$([ $side = base ] && echo "$BASE" || echo .)
    echo "=== $side: $*"
    ( cd "$tree" && PYTHONPATH=$PWD timeout "$limit" "$PYTHON" "${@//@OUT@/$RESULTS/$side}" 2>&1 \
        | grep -E "^\||us|µs" | head -n "$lines" )
  done
}
on_both $((EACH + 40)) 14 -m torchembed bench rope --out @OUT@ --providers torchembed torchembed-hf --no-backward \
  --no-accuracy --max-seconds "$EACH"
on_both 60 16 benchmarks/host_overhead.py --calls 1000 --repeats 5
on_both $((EACH + 40)) 16 -m torchembed bench alibi --kernel --out @OUT@ --passes forward --max-seconds "$EACH"
on_both $((EACH + 40)) 8 -m torchembed bench e2e --out @OUT@ --models llama --variants upstream patched --phases decode \
  --batch-sizes 1 --prompt-lens 512 --repeats 3 --max-seconds "$EACH"
on_both 90 12 -m torchembed bench decode --out @OUT@ --cases gqa gqa-padded alibi
