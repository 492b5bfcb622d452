#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: GPU tests, numerics with the kernel, benchmarks.
# The test suite on the GPU (fused kernels for real), numerics of every family with the fused kernel,
# and the benchmarks. Results (JSON + markdown) go to $RESULTS (default benchmarks/results/<date>),
# logs to $RESULTS/logs.
#   STEPS="tests compare rope alibi e2e" bash benchmarks/probes/gpu_suite.sh
# Uses the interpreter's own torch/triton/transformers (no install of those).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results/$(date +%F)}
STEPS=${STEPS:-tests compare rope alibi e2e}
mkdir -p "$RESULTS/logs"
export PYTHONUNBUFFERED=1 TORCHEMBED_CACHE=${TORCHEMBED_CACHE:-/tmp/torchembed-cache}

"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$RESULTS/logs/install.log" 2>&1 \
  || { echo "editable install failed:"; tail -5 "$RESULTS/logs/install.log"; exit 1; }
"$PYTHON" - <<'PY' | tee "$RESULTS/logs/env.txt"
import platform, torch, triton, transformers
print("date", __import__("datetime").date.today(), "| python", platform.python_version(), "| torch", torch.__version__,
      "| triton", triton.__version__, "| transformers", transformers.__version__,
      "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import torchembed.patches  # noqa: F401  (the package-dir mapping works)
PY

run() {  # run NAME TIMEOUT CMD...: log to $RESULTS/logs/NAME.log, print the tail
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$RESULTS/logs/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$RESULTS/logs/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
}

for step in $STEPS; do
  case $step in
    tests)   run tests "${TESTS_LIMIT:-900}" "$PYTHON" -m pytest -q -x ${TEST_PATHS:-tests/kernels tests/positional tests/functional tests/patches} -p no:cacheprovider ;;
    compare) echo "=== compare (CUDA, fused kernel where it runs) -> compare_cuda.json"
             timeout "${COMPARE_LIMIT:-600}" "$PYTHON" -m torchembed compare --device cuda --json \
               >"$RESULTS/compare_cuda.json" 2>"$RESULTS/logs/compare.log"
             echo "=== compare: rc=$? (1 = a mismatch)" ;;
    tune)    run tune "${TUNE_LIMIT:-600}" "$PYTHON" benchmarks/probes/tune_rope.py ;;
    rope)    run rope "${ROPE_LIMIT:-900}" "$PYTHON" -m torchembed bench rope --out "$RESULTS" ${ROPE_ARGS:-} ;;
    alibi)   run alibi "${ALIBI_LIMIT:-900}" "$PYTHON" -m torchembed bench alibi --out "$RESULTS" ${ALIBI_ARGS:---variants upstream patched patched-kernel} ;;
    alibi-kernel) run alibi-kernel "${ALIBI_KERNEL_LIMIT:-600}" "$PYTHON" benchmarks/probes/alibi_kernel_tune.py --out "$RESULTS" ${ALIBI_KERNEL_ARGS:-} ;;
    e2e)     run e2e "${E2E_LIMIT:-1200}" "$PYTHON" -m torchembed bench e2e --out "$RESULTS" ${E2E_ARGS:-} ;;
    *) echo "unknown step $step" ;;
  esac
done
