"""The checked flag values every command shares: each refuses what it must, with a message naming the value."""

from __future__ import annotations

import argparse
import re

import pytest

from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    device_flag,
    existing_file,
    float_in,
    int_in,
    json_object,
    one_of,
    output_dir,
    output_file,
    positive_int,
    run_main,
)


@pytest.mark.parametrize("parse, text, word", [
    (positive_int, "x", "not an integer"), (positive_int, "0", ">= 1"), (int_in(1, 8), "9", "in [1, 8]"),
    (float_in(0, 1), "nan", "in [0, 1]"), (float_in(0, 1), "inf", "in [0, 1]"), (float_in(0, 1), "1.5", "in [0, 1]"),
    (float_in(0, 1, low_open=True), "0", "in (0, 1]"), (float_in(0, 1), "half", "not a number"),
    (comma_list(positive_int), "1,,4", "empty item"), (comma_list(positive_int), "4,4", "twice"),
    (comma_list(positive_int), "1,x", "not an integer"), (comma_list(one_of("lru", "fifo")), "lru,mru", "'mru'"),
    (json_object, "{bad", "not valid JSON"), (json_object, "[1]", "JSON object"),
    (existing_file, "/nonexistent/file", "not a file"), (existing_file, "/tmp", "a directory"),
    (output_dir, "/proc/x", "cannot write into folder"), (output_file, "/tmp", "a folder"),
    (output_file, "/proc/x/y.json", "cannot write into folder"), (output_file, "/proc/x", "cannot write"),
    (device_flag, "gpu", "not a device"), (device_flag, "cuda:x", "not a device"), (device_flag, "cuda:", "device"),
])
def test_a_bad_value_is_refused_naming_it(parse, text, word):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(word)):
        parse(text)


def test_good_values_parse():
    assert comma_list(positive_int)("1,16,64") == [1, 16, 64]
    assert comma_list(float_in(0, 3))("1, 1.5") == [1.0, 1.5]
    assert float_in(0, 1, low_open=True)("1") == 1.0 and int_in(0)("0") == 0
    assert json_object('{"top_k": 8}') == {"top_k": 8}
    assert [device_flag(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]


def test_a_parse_error_is_one_line_and_exit_2(capsys):
    parser = OneLineParser(prog="cmd")
    parser.add_argument("--n", type=positive_int)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--n", "-3"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "cmd: error: argument --n: must be >= 1, got -3\n"


def test_run_main_turns_a_late_value_error_into_one_line(capsys):
    def main(argv):
        raise ValueError("--prompt-tokens + --output-tokens = 9000 exceeds the model's context (8192 tokens)")

    assert run_main(main, [], prog="cmd") == 2
    assert capsys.readouterr().err == ("cmd: error: --prompt-tokens + --output-tokens = 9000 exceeds the model's "
                                       "context (8192 tokens)\n")

    def opens(argv):
        open("/proc/x/y", "w")

    assert run_main(opens, [], prog="cmd") == 2
    assert capsys.readouterr().err == "cmd: error: /proc/x/y: No such file or directory\n"
    assert run_main(lambda argv: None, [], prog="cmd") == 0

    def bug(argv):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_main(bug, [], prog="cmd")
