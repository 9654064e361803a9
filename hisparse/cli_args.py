"""Checked command-line values, shared by every hisparse command: the server, the benchmarks and the tools.

A flag is checked where argparse reads it, so a typo fails in a second with one line on stderr and exit
status 2, before a model loads, a trace is recorded or a server starts. What only a later check can find (a
value too large for the model's context, an engine argument the engine refuses) is a ValueError naming the
problem, and `run_main` prints it as the same one line instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage before its error; a user wants just the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None,
             prog: str | None = None) -> int:
    """Run a command's `main(argv)`: a ValueError (a value found wrong after parsing) or an OSError (a path that
    cannot be written) ends it with one line on stderr and exit status 2; any other error is a bug and keeps its
    traceback."""
    prog = prog or Path(sys.argv[0]).name
    try:
        code = main(argv)
    except (ValueError, OSError) as error:
        message = str(error) if not isinstance(error, OSError) or not error.strerror else (
            f"{error.filename}: {error.strerror}" if error.filename else error.strerror)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [low, high] (no upper end when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value

    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number in [low, high], or (low, high] with low_open."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (high is not None
                                                                                       and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high, low_open)}, got {text}")
        return value

    return parse


def _range(low: float, high: float | None, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}]"


positive_int = int_in(1)
positive_float = float_in(0.0, low_open=True)


def comma_list(item: Callable[[str], object]) -> Callable[[str], list]:
    """argparse type: a comma-separated list of `item`s, none empty, none twice ("1,16,64")."""
    def parse(text: str) -> list:
        parts = text.split(",")
        if any(not part.strip() for part in parts):
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
        values = [item(part.strip()) for part in parts]
        if len(set(map(repr, values))) != len(values):
            raise argparse.ArgumentTypeError(f"an item given twice in {text!r}")
        return values

    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    """argparse type for the items of a `comma_list`: one of `choices`."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_flag(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N, as torch names them (whether this machine has that device is the
    command's own check)."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cuda, cuda:N or cpu)")
    return text


def json_object(text: str) -> dict:
    """argparse type: a JSON object ('{"top_k": 256}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg} at character {error.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def existing_file(text: str) -> Path:
    """argparse type: a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is {'a directory' if path.is_dir() else 'not a file'}")
    return path


def output_dir(text: str) -> Path:
    """argparse type: a folder results can be written into, created now and written to once (found unwritable
    before the work, not after it; `os.access` would say yes to root even in /proc)."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write into folder {text!r}: {error.strerror}") from None
    return path


def output_file(text: str) -> Path:
    """argparse type: a file that can be written, not a folder: its folder is created and the file opened for
    appending now (a file made only for this is removed again)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    output_dir(str(path.parent))
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {error.strerror}") from None
    if not existed:
        path.unlink()
    return path


_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1073741824' -> bytes. Bare K/M/G/T are binary, as in `free -h`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 512MiB, 2GiB, 1.5GB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return size


def size_flag(text: str) -> int:
    """argparse type: bytes or a size such as 512MiB (`parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
