import sys

from hisparse.bench.missrate import PROG, main
from hisparse.cli_args import run_main

if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
