#!/usr/bin/env bash
# The patches layer against other transformers releases, each in a fresh virtualenv: tests/patches
# and `torchembed compare` on the embedded default.
#
#   bash scripts/test_versions.sh                  # 4.57.x (the last 4.x) and the newest release
#   bash scripts/test_versions.sh 5.17.0 latest    # any version spec; "latest" = the newest release
#
# TORCHEMBED_ZOO_TYPES=sample: the zoo's per-model-type tests only for its sample (every kind of
# rotation and the most used models; CI), else for every model type of each release.
#
# Only torch is pinned (TORCH_SPEC, default the CPU wheel torch==2.13.0); transformers is the newest
# release matching the spec ("latest": the newest on the index, the day it appears) and its
# dependencies what pip picks, as for a user; a dependency the index does not serve is left out and
# named in the log (scripts/install_transformers.py). Virtualenvs live in
# $TORCHEMBED_VENVS (default ~/.cache/torchembed/venvs) and are made anew on every run; pip's
# cache keeps that quick on a machine that ran it before.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
root=${TORCHEMBED_VENVS:-$HOME/.cache/torchembed/venvs}
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=("4.57.*" "latest")
for spec in "${specs[@]}"; do
  venv="$root/transformers-${spec//\*/x}"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip packaging
  "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  # the newest release matching the spec, even where the index lacks one of its dependencies (then
  # installed without it, and the log says so)
  "$venv/bin/python" scripts/install_transformers.py "$spec"
  version=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
  echo "== transformers $version ($spec): tests/patches"
  # (the tests marked slow, which start processes or compile, run with the pinned release only)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${TORCHEMBED_TEST_WORKERS:-auto}" --dist loadgroup -m "not slow" tests/patches
  echo "== transformers $version ($spec): torchembed compare"
  "$venv/bin/python" -m torchembed compare
done
