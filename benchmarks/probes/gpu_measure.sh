#!/usr/bin/env bash
# The measurements behind the README's ALiBi and RoPE host/CPU tables, in one GPU-machine call.
# The ALiBi attention layer against its anchors, the ALiBi models, the RoPE host time per decode call,
# and SmolLM2-135M-shaped end-to-end on the host's CPU (float32 and bf16, 1 and 4 threads).
#   OUT=DIR bash benchmarks/probes/gpu_measure.sh      (results and logs in DIR, packed into DIR/results.tar)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-torchembed-results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT/m"
export PYTHONUNBUFFERED=1 TORCHEMBED_CACHE=${TORCHEMBED_CACHE:-/tmp/torchembed-cache}
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
step() {  # step NAME LIMIT CMD...: its log and result files are added to $OUT/results.tar at once
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/m/$name.log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - start)) s"
  tar -C "$OUT" -cf "$OUT/results.tar" m
}
# (the limits add up to under the device tool's 10 minutes per command)
# (one round per cell to fit the call; the README's layer table takes three: --rounds 3 --max-seconds 300)
step alibi-kernel 170 "$PYTHON" -m torchembed bench alibi --kernel --rounds 1 --max-seconds 150 --out "$OUT/m"
step alibi-models 180 "$PYTHON" -m torchembed bench alibi --out "$OUT/m" --models bloom mpt falcon \
  --variants upstream patched --max-seconds 160
step rope-host 60 "$PYTHON" benchmarks/host_overhead.py --calls 2000 --repeats 7
for dtype in float32 bfloat16; do
  step "e2e-cpu-$dtype" 80 "$PYTHON" -m torchembed bench e2e --device cpu --models smollm2 --threads 1 4 \
    --dtype "$dtype" --batch-sizes 1 --prompt-lens 128 --new-tokens 16 --repeats 9 --max-seconds 70 \
    --name "e2e-cpu-$dtype" --out "$OUT/m"
done
grep -h -A12 "^## prefill, forward$" "$OUT/m/alibi-kernel.md" | head -12
tail -14 "$OUT/m/rope-host.log"
