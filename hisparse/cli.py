"""The `hisparse` console script: `hisparse serve ...` is `python -m hisparse.launch_server ...`."""

from __future__ import annotations

import sys

USAGE = """usage: hisparse <command> [flags]

commands:
  serve    start the OpenAI-compatible server (hisparse serve --help for its flags)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not argv:  # a mistake, so stderr, as argparse does: the usage, then the one line naming the problem
        print(USAGE + "hisparse: error: a command is required (known: serve)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from hisparse.launch_server import main as serve

        return serve(rest, prog="hisparse serve")
    print(f"hisparse: error: unknown command {command!r} (known: serve)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
