#!/usr/bin/env bash
# Set up, then run the test suite. Without a GPU the Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pytest -q "$@"
