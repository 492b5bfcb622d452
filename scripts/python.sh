# Sourced by the scripts: sets PYTHON to the interpreter torchembed is installed for.
# Inside a virtualenv (or conda env): that environment's interpreter. Outside one: the repository's
# .venv, which scripts/setup.sh makes (a system Python such as Debian's or Ubuntu's refuses
# `pip install` outside a virtualenv, PEP 668). PYTHON picks the base interpreter (default python3).
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import os, sys; sys.exit(sys.prefix == sys.base_prefix and "CONDA_PREFIX" not in os.environ)' 2>/dev/null; then
  TORCHEMBED_BASE_PYTHON=$PYTHON
  PYTHON=$PWD/.venv/bin/python
fi
export PYTHON
