"""`python -m hisparse.bench_serving`: the real server under load.

- `--workload hisparse` (the default): HiSparse off vs on, same device KV budget, at a sweep of concurrencies
  (hisparse/bench/serving.py);
- `--workload prefix-reuse`: shared-prefix and multi-turn chat workloads with the radix cache on and off, HiSparse
  off and on (hisparse/bench/prefix_reuse.py);
- `--pd`: router + prefill + decode servers against a co-located one, HiSparse off and on on the decode side
  (hisparse/bench/pd_serving.py).
"""

import argparse
import sys

from hisparse.cli_args import run_main

WORKLOADS = ("hisparse", "prefix-reuse")


def main(argv: list[str] | None = None) -> int:
    picker = argparse.ArgumentParser(add_help=False)
    picker.add_argument("--workload", choices=WORKLOADS, default="hisparse")
    picker.add_argument("--pd", action="store_true")
    known, rest = picker.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.pd:
        from hisparse.bench import pd_serving

        return run_main(pd_serving.main, rest, prog=pd_serving.PROG)
    if known.workload == "prefix-reuse":
        from hisparse.bench import prefix_reuse

        return run_main(prefix_reuse.main, rest, prog=prefix_reuse.PROG)
    from hisparse.bench import serving

    return run_main(serving.main, rest, prog=serving.PROG)


if __name__ == "__main__":
    sys.exit(main())
