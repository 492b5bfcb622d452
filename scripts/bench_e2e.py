"""`torchembed bench e2e` as a script: python scripts/bench_e2e.py [--smoke] [--out DIR] ... (--help)."""

import sys

from torchembed.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["e2e", *sys.argv[1:]]))
