"""`python -m hisparse.bench_serving`: HiSparse off vs on behind the real server, same device KV budget, at a
sweep of concurrencies (see hisparse/bench/serving.py)."""

import sys

from hisparse.bench.serving import PROG, main
from hisparse.cli_args import run_main

if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
