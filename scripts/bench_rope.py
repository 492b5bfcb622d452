"""`torchembed bench rope` as a script: python scripts/bench_rope.py [--smoke] [--out DIR] ... (--help)."""

import sys

from torchembed.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["rope", *sys.argv[1:]]))
