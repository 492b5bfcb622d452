#!/usr/bin/env bash
# The main job: set up, then compare torchembed-patched models with upstream on the embedded
# default (tiny random-weight checkpoints of every supported family, no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m torchembed list
"$PYTHON" -m torchembed compare "$@"
