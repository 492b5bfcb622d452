"""`torchembed bench alibi` as a script: python scripts/bench_alibi.py [--smoke] [--out DIR] ... (--help)."""

import sys

from torchembed.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["alibi", *sys.argv[1:]]))
