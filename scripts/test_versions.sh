#!/usr/bin/env bash
# The patches layer against other transformers releases, each in a fresh virtualenv: tests/patches
# and `torchembed compare` on the embedded default.
#
#   bash scripts/test_versions.sh                  # 4.57.x (the last 4.x) and the newest release
#   bash scripts/test_versions.sh 5.17.0 latest    # any version spec; "latest" = the newest release
#   bash scripts/test_versions.sh --install SPEC.. # only make the virtualenvs (CI: while the main suite runs)
#   bash scripts/test_versions.sh --test SPEC..    # only test in the virtualenvs --install made
#
# TORCHEMBED_ZOO_TYPES=sample: the zoo's per-model-type tests only for its sample (every kind of
# rotation and the most used models; CI), else for every model type of each release.
# COMPARE_ARGS: options of `torchembed compare` (CI: --dtype bfloat16; the float32 check is the tests').
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
install=1 test=1
case "${1:-}" in
  --install) test=0; shift ;;
  --test) install=0; shift ;;
  --*) echo "test_versions.sh: unknown option $1 (--install or --test)" >&2; exit 2 ;;
esac
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=("4.57.*" "latest")
for spec in "${specs[@]}"; do
  venv="$root/transformers-${spec//\*/x}"
  if [ "$install" = 1 ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip packaging
    "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    # the newest release matching the spec, even where the index lacks one of its dependencies (then
    # installed without it, and the log says so); --install leaves torchembed itself to --test: its
    # editable install writes into the repository, which another install may be writing (CI)
    "$venv/bin/python" scripts/install_transformers.py $([ "$test" = 1 ] || echo --no-project) "$spec"
  fi
  [ "$test" = 1 ] || continue
  if [ ! -x "$venv/bin/python" ]; then
    echo "test_versions.sh: no virtualenv for $spec at $venv (run with --install first)" >&2
    exit 1
  fi
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("torchembed")' 2>/dev/null; then
    "$venv/bin/python" -m pip install -q --no-deps -e .
  fi
  version=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
  echo "== transformers $version ($spec): tests/patches"
  # (the tests marked slow, which start processes or compile, run with the pinned release only)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${TORCHEMBED_TEST_WORKERS:-auto}" --dist loadgroup -m "not slow" tests/patches
  echo "== transformers $version ($spec): torchembed compare"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m torchembed compare ${COMPARE_ARGS:-}
done
