#!/usr/bin/env bash
# The GPU measurements behind the decode results, by phase (each fits one device call; results in $OUT):
#   suite   - the whole test suite on the GPU (benchmarks/gpu_suite.py run): gpu-suite.md and .json in $OUT, to be
#             copied to benchmarks/results/; COMMIT=$(git rev-parse HEAD) names the tree (the machine has no git)
#   tests   - the CUDA tests of the decode route and the nothing-global suite
#   kernel-tests - the split-key kernel's tests on CUDA
#   splits  - the split-key decode's whole call and its combine alone under key-split settings (decode_splits_graph.py)
#   ceiling - a kernel that only reads the decode step's K and V, against the floor and the split-key decode
#   single-launch - the split-key decode in one launch (last ticket merges) against the library's two (batch 1)
#   sweep   - the split-key kernel's launch configurations at 16k keys (CASES: padded batch 4 and static cache, or batch 1) against SDPA
#             (torchembed bench decode --sweep)
#   decode  - torchembed bench decode (decode attention against its floor and SDPA's backends)
#   depth   - full-depth decode per step: MPT-7B-StoryWriter and BLOOM-7B1 shapes at 65k, LLaMA-3.1-8B at 128k
#   compiled - compiled static-cache generate at 64k (8 layers), upstream and patched, and the padded batch
#   short   - compiled static-cache decode of ~1B LLaMA and Qwen3 at 512 and 4k (torchembed bench e2e)
#   compiled-more - compiled static-cache generate at 64k for the Qwen3-8B and Falcon-ALiBi shapes
#   compiled-depth - eager and compiled static-cache decode at 64k at full depth: LLaMA-3.1-8B (32 layers), BLOOM-7B1 (30),
#             Qwen3-8B (36), Falcon-ALiBi (32) shapes (MODELS="llama bloom" for some)
#   rerecord - why compiled static-cache generate re-records its CUDA graph (LLaMA, 4 layers, 16k; the reasons logged)
#   decode-ab - torchembed bench decode on the tree in _baseline and on this one, in turn (carry _baseline)
#   generate-profile - where compiled static-cache generate spends each token beyond the compiled step (LLaMA, 32 layers, 64k)
#   kinds   - one compiled step of full-depth LLaMA-3.1-8B at 64k, patched and upstream, its GPU time by kernel kind
#   depth-profile - full-depth MPT at 65k through the profile probe (a filled cache, no prefill)
#   depth-again - the same through bench long (the cache of a 65k prefill)
#   before-after - speed of this tree against the tree in _baseline (compare_commits_gpu.sh; carry _baseline)
#   profile - where one decode step's time goes (8 layers, 64k keys): eager and compiled, upstream and patched
#   plain   - what a user's plain call costs: ALiBi prefills of one 128-2048-token sequence, upstream against patched,
#             profiled (alibi_prefill_profile.py); plain generate() per token (LLaMA and MPT, 8 layers, 16k); the eager
#             decode step by kind (LLaMA, 8 layers, 64k)
#   plain-depth - plain generate() per token at full depth (LLaMA-3.1-8B at 128k, MPT-7B-StoryWriter and BLOOM-7B1 at
#             65k), patched, beside the model's own decode loop and the floor (bench long --generate)
#   growth  - one decode step over a long DynamicCache, patched (grows in place) against upstream (torch.cat)
#   graphs  - plain generate() with the patched model's decode steps replayed from CUDA graphs: the graphs' CUDA tests,
#             LLaMA-3.1-8B shape 8 layers at 64k (upstream and patched), eager generate of ~1B LLaMA and Qwen3 at 512
#             and 4k (upstream and patched); `plain-depth` measures the full-depth shapes
#   alibi-graphs - BLOOM and MPT decode steps replayed from CUDA graphs: the graphs' CUDA tests, then plain generate()
#             per token, patched, at 16k (8 layers) beside the model's own loop and the floor; `plain-depth` for 65k
#   batch   - transformers' continuous batching (generate_batch) of a ~1B LLaMA, upstream against patched: float32
#             tokens equal, bf16 throughput (benchmarks/probes/generate_batch_throughput.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-torchembed-results}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then  # another transformers, from the wheel carried in the folder WHEELS (run's carry), made
  # here with `pip download --no-deps -d .whl transformers==5.23.0` (its needs must be the machine's: a venv made from
  # the machine's python3, itself a venv, would not see them). Installed beside the machine's packages, ahead of them.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import transformers; print('transformers', transformers.__version__)"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
for phase in "$@"; do
  case "$phase" in
    suite)
      timeout "${LIMIT:-570}" python3 benchmarks/gpu_suite.py run --out "$OUT" --commit "${COMMIT:-}" --workers "${WORKERS:-12}" \
        --timeout "${TEST_TIMEOUT:-240}" ${SUITE_ARGS:-} > "$OUT/suite.log" 2>&1
      echo "suite: exit $?"
      [ -f "$OUT/gpu-suite.json" ] || python3 benchmarks/gpu_suite.py markdown "$OUT/gpu-suite.jsonl" --commit "${COMMIT:-}"
      cat "$OUT/gpu-suite.md" ;;
    tests)
      for file in tests/patches/test_decode_attention.py tests/patches/test_nothing_global.py; do
        timeout 280 python3 -m pytest -q -p no:cacheprovider "$file" --tb=short -k cuda 2>&1 | tail -n 15  # (a fresh machine: the threads test 108 s)
      done | tee "$OUT/tests.log" ;;
    kernel-tests)  # the split-key kernel's tests on CUDA, one line per test as it ends
      timeout 300 python3 -m pytest -v -p no:cacheprovider tests/kernels/test_alibi_flash.py --tb=short --durations=8 \
        -k "without_a_bias or only_the_keys or compiles_once" 2>&1 | grep -E "PASS|FAIL|ERROR|Error|passed|failed|s call" \
        | tee "$OUT/kernel-tests.log" ;;
    splits)  # the split-key decode under key-split settings and blocks, the combine alone (from a CUDA graph)
      timeout 200 python3 benchmarks/probes/decode_splits_graph.py --out "$OUT" 2>&1 | grep "^|" ;;
    ceiling)  # the read ceiling of batch-1 decode at 16k / 64k / 128k keys (decode_read_ceiling.py)
      timeout 200 python3 benchmarks/probes/decode_read_ceiling.py --out "$OUT" 2>&1 | grep "^|" ;;
    single-launch)
      timeout 250 python3 benchmarks/probes/decode_single_launch.py --out "$OUT" 2>&1 | grep "^|" ;;
    sweep)  # the split-key kernel's launch configurations at 16k (CASES; all three outrun one call), against SDPA
      timeout 560 python3 -m torchembed bench decode --sweep --cases ${CASES:-gqa-padded static} --keys 16384 \
        --name decode-sweep-16k --out "$OUT" 2>&1 | grep -E "^\| (gqa|static)" ;;
    decode)
      timeout 170 python3 -m torchembed bench decode --out "$OUT" 2>&1 | grep -v Warning | grep -v "return {" | tail -n 18 ;;
    depth)
      for spec in "mpt 32 65536" "bloom 30 65536" "llama 32 131072"; do
        set -- $spec
        timeout 100 python3 -m torchembed bench long --models "$1" --variants patched --layers "$2" --contexts "$3" \
          --steps 6 --name "long-depth-$1" --out "$OUT" 2>&1 | grep "^| $1"
      done ;;
    plain-depth)  # plain generate() per token at full depth, patched (upstream runs out of memory or crawls there)
      for spec in "llama 32 131072" "mpt 32 65536" "bloom 30 65536"; do
        set -- $spec
        timeout 190 python3 -m torchembed bench long --models "$1" --variants patched --layers "$2" --contexts "$3" \
          --steps 6 --generate 16 --max-seconds 180 --name "long-plain-depth-$1" --out "$OUT" 2>&1 | grep "^| $1"
      done ;;
    compiled)
      timeout 200 python3 -m torchembed bench long --models llama --contexts 65536 --layers 8 --steps 6 \
        --compiled 16 --name long-compiled-llama --out "$OUT" 2>&1 | grep "^| llama"
      timeout 100 python3 -m torchembed bench long --models bloom --variants patched --contexts 65536 --layers 8 \
        --steps 6 --compiled 16 --name long-compiled-bloom --out "$OUT" 2>&1 | grep "^| bloom"
      timeout 110 python3 benchmarks/probes/padded_generate.py --contexts 4096 16384 --layers 8 --repeats 2 \
        --out "$OUT/padded-generate.json" 2>&1 | tail -n 4 ;;
    short)  # compiled static-cache decode of ~1B LLaMA and Qwen3 at short context, upstream against patched
      timeout 200 python3 -m torchembed bench e2e --models llama qwen3 --variants upstream patched \
        --phases compiled compiled-step --batch-sizes 1 --prompt-lens 512 4096 --repeats 3 --max-seconds 150 \
        --name e2e-compiled-short --out "$OUT" 2>&1 | grep -E "^\| (llama|qwen3)" ;;
    compiled-more)  # compiled static-cache generate at 64k (8 layers): Qwen3-8B and Falcon-ALiBi shapes
      timeout 240 python3 -m torchembed bench long --models qwen3 falcon --contexts 65536 --layers 8 --steps 6 \
        --compiled 16 --max-seconds 200 --name long-compiled-qwen3-falcon --out "$OUT" 2>&1 | grep -E "^\| (qwen3|falcon)" ;;
    compiled-depth)
      for spec in ${MODELS:-llama bloom qwen3 falcon}; do
        layers=$(case $spec in llama|falcon) echo 32;; bloom) echo 30;; qwen3) echo 36;; esac)
        timeout 280 python3 -m torchembed bench long --models "$spec" --variants patched --layers "$layers" \
          --contexts 65536 --steps 4 --compiled 48 --max-seconds 250 --name "long-compiled-depth-$spec" --out "$OUT" \
          2>&1 | grep -E "^\| $spec|Error"
      done ;;
    generate-profile)
      timeout 400 python3 benchmarks/probes/generate_profile.py --model llama --layers 32 --keys 65536 \
        --variants patched upstream --out "$OUT" 2>&1 | grep -E "^##|^\||^- " ;;
    rerecord)
      timeout 200 python3 benchmarks/probes/generate_profile.py --model llama --layers 4 --keys 16384 --tokens 9 \
        --variants patched upstream --why --out "$OUT/rerecord" 2>&1 | grep -E "^##|re-record|counters|cudaDevice|cuLaunch" ;;
    decode-ab)  # the split-key decode of _baseline's tree against this one's, each case on both before the next
      for case in ${CASES:-gqa alibi gqa-padded static}; do
        for side in base new; do
          tree=$([ $side = base ] && echo _baseline || echo .)
          ( cd "$tree" && PYTHONPATH=$PWD timeout 100 python3 -m torchembed bench decode --cases "$case" \
              --name "decode-ab-$case-$side" --out "$OUT" 2>&1 | grep "^| $case" | sed "s/^/$side /" )
        done
      done ;;
    kinds)  # where the compiled step's GPU time goes beyond the attention: matmuls, inductor's kernels, the library's
      timeout 400 python3 benchmarks/probes/decode_step_profile.py --model llama --keys 65536 --layers 32 \
        --variants patched-compiled upstream-compiled --out "$OUT/kinds" 2>&1 | grep -E "^\||^GPU" ;;
    depth-profile)  # full-depth MPT at 65k: the profile's filled cache against bench long's prefilled one
      timeout 200 python3 benchmarks/probes/decode_step_profile.py --model mpt --keys 65536 --layers 32 \
        --variants patched --out "$OUT/full" 2>&1 | grep "^|" ;;
    depth-again)
      timeout 150 python3 -m torchembed bench long --models mpt --variants patched --layers 32 --contexts 65536 \
        --steps 8 --name long-depth-mpt-again --out "$OUT" 2>&1 | grep "^| mpt" ;;
    before-after)  # this tree against another commit's tree in _baseline (carried), side by side:
      # git archive 0244682 | tar -x -C _baseline   (the tree before the nothing-global and walkable-house work)
      BASE=_baseline RESULTS="$OUT/before-after" SECONDS_EACH=${SECONDS_EACH:-30} timeout "${LIMIT:-590}" \
        bash benchmarks/probes/compare_commits_gpu.sh 2>&1 | tee "$OUT/before-after.log"
      tar -C "$OUT" -czf "$OUT/before-after.tgz" before-after && rm -rf "$OUT/before-after" ;;  # (few files come back)
    profile)
      timeout 190 python3 benchmarks/probes/decode_step_profile.py --model llama --keys 65536 --layers 8 \
        --variants upstream patched upstream-compiled patched-compiled --out "$OUT" 2>&1 | grep "^|"
      timeout 150 python3 benchmarks/probes/decode_step_profile.py --model bloom --keys 65536 --layers 8 \
        --variants upstream patched patched-compiled --out "$OUT" 2>&1 | grep "^|"
      timeout 150 python3 benchmarks/probes/decode_step_profile.py --model mpt --keys 65536 --layers 8 --out "$OUT" 2>&1 | grep "^|" ;;
    plain)
      timeout 150 python3 benchmarks/probes/alibi_prefill_profile.py --out "$OUT" 2>&1 | grep -E "^\||^- |^##"
      timeout 150 python3 -m torchembed bench long --models llama mpt --contexts 16384 --layers 8 --steps 6 \
        --generate 32 --max-seconds 140 --name long-plain-generate --out "$OUT" 2>&1 | grep -E "^\| (llama|mpt)"
      timeout 190 python3 benchmarks/probes/decode_step_profile.py --model llama --keys 65536 --layers 8 \
        --variants upstream patched --out "$OUT" 2>&1 | grep -E "^\||^GPU" ;;
    graphs)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/patches/test_decode_graphs.py --tb=short 2>&1 | tail -n 12
      timeout 170 python3 -m torchembed bench long --models llama --contexts 65536 --layers 8 --steps 6 --generate 32 \
        --max-seconds 150 --name long-plain-graphs --out "$OUT" 2>&1 | grep -E "^\| llama"
      timeout 200 python3 -m torchembed bench e2e --models llama qwen3 --variants upstream patched --phases decode \
        --batch-sizes 1 --prompt-lens 512 4096 --repeats 3 --max-seconds 180 --name e2e-plain-graphs --out "$OUT" 2>&1 \
        | grep -E "^\| (llama|qwen3)" ;;
    alibi-graphs)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/patches/test_decode_graphs.py --tb=short -k cuda 2>&1 | tail -n 12
      timeout 220 python3 -m torchembed bench long --models bloom mpt --variants patched --contexts 16384 --layers 8 \
        --steps 6 --generate 32 --max-seconds 200 --name long-plain-alibi-graphs --out "$OUT" 2>&1 | grep -E "^\| (bloom|mpt)" ;;
    batch)
      timeout 300 python3 benchmarks/probes/generate_batch_throughput.py --out "$OUT" 2>&1 | grep -E "^\||tokens|Error" ;;
    growth)
      for model in llama bloom; do
        timeout 120 python3 benchmarks/probes/cache_growth.py --model "$model" --keys 16384 65536 --layers 8 \
          --hidden 4096 --kv-heads 8 --steps 8 --repeats 3 --out "$OUT" 2>&1 | tail -n 6
      done ;;
  esac
done
