#!/usr/bin/env bash
# Set up, then run the test suite. Without a GPU the Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
# One test process per core (pytest-xdist), each on one thread: the tests are many small models,
# so processes use the cores better than intra-op threads. TORCHEMBED_TEST_WORKERS=0: one process.
# tests.tools.xdist_quiet_exit: the workers end before xdist interrupts them (its docstring says why).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "test.sh: running the test suite (about 10 minutes on a 2-core CPU; a dot per passed test)"
"$PYTHON" -m pytest -q -n "${TORCHEMBED_TEST_WORKERS:-auto}" --dist loadgroup -p tests.tools.xdist_quiet_exit "$@"
