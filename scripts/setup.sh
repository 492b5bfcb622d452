#!/usr/bin/env bash
# Install torchembed (editable) with every extra, pinned by scripts/constraints.txt.
# PYTHON picks the interpreter (default python3); TORCH_SPEC overrides the torch requirement
# (e.g. TORCH_SPEC=torch on a CUDA machine that should keep its own build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$PYTHON" -m pip install -q -c scripts/constraints.txt -e ".[triton,hf,dev]"
